/* The exhaustive search of the compiled model: breadth first over canonical states (the
 * visited set holds each state's compact encoding cut into parts, each part kept once,
 * packed), every safety invariant in every new state and after every hook inside a step, an
 * event with no table row as a finding;
 * then, on the explored graph, the progress properties as liveness under weak fairness (fair
 * strongly connected components of the states where the property is not yet met), and the old
 * reachability check (a quiescent state reachable from every state) for comparison. A
 * counterexample is a path of events (a lasso for liveness), which Python replays. The
 * expansion of states and the liveness pass run on a crew of threads; the answer is the
 * same, state for state, on any number of them (the search, below). */
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "model.h"

#define ENC_MAX 2048
/* the events of a state at most (kv_events), so the edges out of it */
#define MAX_EVENTS 64
_Static_assert(MAX_EVENTS <= UINT8_MAX, "a state's event index is a byte (Succ, Graph)");
/* a packed encoding's bound: a mask byte per 8 bytes, and the byte kv_pack writes past it */
#define PACK_MAX (ENC_MAX + ENC_MAX / 8 + 8)

/* ============================================================== compact encoding */
/* a request's blocks (prompt and output, in every group), as encoded */
static int max_blocks(const Bounds *b) { return b->groups * kv_blocks_of(b, b->tokens + b->decode_tokens); }

/* a set of keys takes 2 bytes, or 4 beyond 16 keys (one group's bounds encode as before) */
static int mask_bytes(const Bounds *b) { return kv_nkeys(b) > 16 ? 4 : 2; }

/* a window group (sliding or Mamba): requests keep the tokens their last step computed
 * and stores fence their sources at once (other bounds encode as before) */
static int has_windows(const Bounds *b) { return (b->sliding | b->mamba) != 0; }

/* a store may write a chunk in part (a window group in chunks of several blocks: a sliding
 * window's freed leading blocks, a Mamba state's one block): the data's truth of partial
 * chunks and unwritten reads is encoded (other bounds as before) */
static int writes_in_part(const Bounds *b) { return has_windows(b) && b->blocks_per_chunk > 1; }

static int put_mask(int w, KeyMask m, uint8_t *o) {
    for (int i = 0; i < w; i++) o[i] = (uint8_t)(m >> (8 * i));
    return w;
}

static int get_mask(int w, KeyMask *m, const uint8_t *o) {
    *m = 0;
    for (int i = 0; i < w; i++) *m |= (KeyMask)o[i] << (8 * i);
    return w;
}

static int put_req(const Bounds *b, int mw, const Req *q, uint8_t *o) {
    int n = 0, T = max_blocks(b);
    o[n++] = q->state; o[n++] = q->flags; o[n++] = q->hit; o[n++] = q->cursor;
    o[n++] = q->kv_load; o[n++] = q->nblocks; o[n++] = q->signals; o[n++] = q->after_signal;
    /* a rule's field only where the bounds can set it (0.33.0's bounds encode as before) */
    if (b->failed_load_for_life) o[n++] = q->load_failed;
    if (b->store_threshold > 1 && b->per_request_admission) n += put_mask(mw, q->counted, o + n);
    for (int i = 0; i < 4; i++) o[n++] = (uint8_t)(q->jobs >> (8 * i));
    for (int i = 0; i < T; i++) o[n++] = q->blocks[i];
    o[n++] = q->cstatus; o[n++] = q->computed; o[n++] = q->loading; o[n++] = q->aborted;
    o[n++] = q->ncblocks; o[n++] = q->ckv_bad; o[n++] = q->cload;
    if (b->stale_fence_only) o[n++] = q->crecv_failed;
    if (b->decode_tokens) o[n++] = q->generated;
    for (int i = 0; i < T; i++) o[n++] = q->cblocks[i];
    if (has_windows(b)) o[n++] = q->window_end;
    if (b->mamba) o[n++] = q->cpromoted;
    return n;
}

static int put_job(const Bounds *b, int mw, const Job *j, uint8_t *o) {
    int n = 0, T = max_blocks(b);
    o[n++] = j->id; o[n++] = j->kind; o[n++] = j->owner; o[n++] = j->state;
    o[n++] = j->pending; o[n++] = j->unreported; o[n++] = j->age; o[n++] = j->held_slots;
    o[n++] = j->flags; o[n++] = j->nblocks;
    n += put_mask(mw, j->keys, o + n);
    o[n++] = (uint8_t)j->deferred; o[n++] = (uint8_t)(j->deferred >> 8);
    if (has_windows(b)) { o[n++] = (uint8_t)j->fenced; o[n++] = (uint8_t)(j->fenced >> 8); }
    for (int k = 0; k < T; k++) o[n++] = j->blocks[k];
    return n;
}

int kv_encode(const Bounds *b, const State *s, uint8_t *o) {
    int n = 0, K = kv_nkeys(b), mw = mask_bytes(b);
    for (int r = 0; r < b->requests; r++) n += put_req(b, mw, &s->req[r], o + n);
    o[n++] = s->njobs;
    for (int i = 0; i < s->njobs; i++) n += put_job(b, mw, &s->job[i], o + n);
    o[n++] = s->counter; o[n++] = s->threshold; o[n++] = s->fence; o[n++] = s->reset_since_step;
    o[n++] = s->pending_finished; o[n++] = s->pending_preempted;
    for (int i = 0; i < 3; i++) o[n++] = s->budget[i];
    for (int k = 0; k < K; k++) o[n++] = (uint8_t)s->chunk[k];
    if (b->store_threshold > 1)
        for (int k = 0; k < K; k++) o[n++] = s->offers[k];
    n += put_mask(mw, s->being_loaded, o + n);
    o[n++] = (uint8_t)s->free_blocks; o[n++] = (uint8_t)(s->free_blocks >> 8);
    n += put_mask(mw, s->bad_chunks, o + n);
    for (int i = 0; i < 4; i++) o[n++] = (uint8_t)(s->to_flush >> (8 * i));
    for (int blk = 0; blk < b->gpu_blocks; blk++)
        for (int i = 0; i < 4; i++) o[n++] = (uint8_t)(s->block_fence[blk] >> (8 * i));
    if (writes_in_part(b)) {
        for (int k = 0; k < K; k++) o[n++] = s->partial[k];
        n += put_mask(mw, s->unwritten, o + n);
    }
    if (b->partial_tails) n += put_mask(mw, s->misplaced, o + n);  /* the truth of INV-22 */
    return n;
}

static int get_req(const Bounds *b, int mw, Req *q, const uint8_t *o) {
    int n = 0, T = max_blocks(b);
    q->state = o[n++]; q->flags = o[n++]; q->hit = o[n++]; q->cursor = o[n++];
    q->kv_load = o[n++]; q->nblocks = o[n++]; q->signals = o[n++]; q->after_signal = o[n++];
    if (b->failed_load_for_life) q->load_failed = o[n++];
    if (b->store_threshold > 1 && b->per_request_admission) n += get_mask(mw, &q->counted, o + n);
    q->jobs = 0;
    for (int i = 0; i < 4; i++) q->jobs |= (uint32_t)o[n++] << (8 * i);
    for (int i = 0; i < T; i++) q->blocks[i] = o[n++];
    q->cstatus = o[n++]; q->computed = o[n++]; q->loading = o[n++]; q->aborted = o[n++];
    q->ncblocks = o[n++]; q->ckv_bad = o[n++]; q->cload = o[n++];
    if (b->stale_fence_only) q->crecv_failed = o[n++];
    if (b->decode_tokens) q->generated = o[n++];
    for (int i = 0; i < T; i++) q->cblocks[i] = o[n++];
    if (has_windows(b)) q->window_end = o[n++];
    if (b->mamba) q->cpromoted = o[n++];
    return n;
}

static int get_job(const Bounds *b, int mw, Job *j, const uint8_t *o) {
    int n = 0, T = max_blocks(b);
    memset(j, 0, sizeof *j);
    j->id = o[n++]; j->kind = o[n++]; j->owner = o[n++]; j->state = o[n++];
    j->pending = o[n++]; j->unreported = o[n++]; j->age = o[n++]; j->held_slots = o[n++];
    j->flags = o[n++]; j->nblocks = o[n++];
    n += get_mask(mw, &j->keys, o + n);
    j->deferred = (uint16_t)(o[n] | (o[n + 1] << 8)); n += 2;
    if (has_windows(b)) { j->fenced = (uint16_t)(o[n] | (o[n + 1] << 8)); n += 2; }
    for (int k = 0; k < T; k++) j->blocks[k] = o[n++];
    return n;
}

void kv_decode(const Bounds *b, const uint8_t *o, State *s) {
    int n = 0, K = kv_nkeys(b), mw = mask_bytes(b);
    memset(s, 0, offsetof(State, job));  /* the records beyond njobs are not read */
    for (int k = 0; k < MAXK; k++) s->chunk[k] = CH_ABSENT;
    for (int r = 0; r < b->requests; r++) n += get_req(b, mw, &s->req[r], o + n);
    s->njobs = o[n++];
    for (int i = 0; i < s->njobs; i++) n += get_job(b, mw, &s->job[i], o + n);
    s->counter = o[n++]; s->threshold = o[n++]; s->fence = o[n++]; s->reset_since_step = o[n++];
    s->pending_finished = o[n++]; s->pending_preempted = o[n++];
    for (int i = 0; i < 3; i++) s->budget[i] = o[n++];
    for (int k = 0; k < K; k++) s->chunk[k] = (int8_t)o[n++];
    if (b->store_threshold > 1)
        for (int k = 0; k < K; k++) s->offers[k] = o[n++];
    n += get_mask(mw, &s->being_loaded, o + n);
    s->free_blocks = (uint16_t)(o[n] | (o[n + 1] << 8)); n += 2;
    n += get_mask(mw, &s->bad_chunks, o + n);
    s->to_flush = 0;
    for (int i = 0; i < 4; i++) s->to_flush |= (uint32_t)o[n++] << (8 * i);
    for (int blk = 0; blk < b->gpu_blocks; blk++) {
        s->block_fence[blk] = 0;
        for (int i = 0; i < 4; i++) s->block_fence[blk] |= (uint32_t)o[n++] << (8 * i);
    }
    if (writes_in_part(b)) {
        for (int k = 0; k < K; k++) s->partial[k] = o[n++];
        n += get_mask(mw, &s->unwritten, o + n);
    }
    if (b->partial_tails) n += get_mask(mw, &s->misplaced, o + n);
}

/* ============================================================== an encoding's parts */
/* The visited set (below) holds an encoding as its parts: each request's, the job records'
 * (their count, then the records), and the rest (the manager, the core's counters, the
 * data's truth). A request's part and a job record each have one length for the bounds
 * (put_req and put_job of a zero record). */
#define MAX_PARTS (MAXR + 2)

typedef struct {
    int req, job, rest;   /* the bytes of a request's part, of a job record, of the rest */
    int nparts;           /* the requests' parts, the job records', the rest */
} Parts;

static Parts parts_for(const Bounds *b) {
    static State zero;    /* no job records: its encoding is the parts but the jobs' count */
    uint8_t o[ENC_MAX];
    Parts pt = {put_req(b, mask_bytes(b), &zero.req[0], o),
                put_job(b, mask_bytes(b), &zero.job[0], o), 0, b->requests + 2};
    pt.rest = kv_encode(b, &zero, o) - b->requests * pt.req - 1;
    return pt;
}

/* the length of part p, which starts at `part` */
static int part_bytes(const Parts *pt, int p, const uint8_t *part) {
    if (p < pt->nparts - 2) return pt->req;
    if (p == pt->nparts - 2) return 1 + part[0] * pt->job;
    return pt->rest;
}

/* where each part of an encoding starts (start[nparts]: its length, which it returns) */
static int parts_of(const Parts *pt, const uint8_t *enc, int *start) {
    start[0] = 0;
    for (int p = 0; p < pt->nparts; p++)
        start[p + 1] = start[p] + part_bytes(pt, p, enc + start[p]);
    return start[pt->nparts];
}

/* the parts of an encoding of `len` bytes, for the tests: their count, and where each starts;
 * -1 if they do not end where it does */
int kv_parts(const Bounds *b, const uint8_t *enc, int len, int32_t *start) {
    Parts pt = parts_for(b);
    int at[MAX_PARTS + 1];
    if (parts_of(&pt, enc, at) != len) return -1;
    for (int p = 0; p <= pt.nparts; p++) start[p] = at[p];
    return pt.nparts;
}

/* ============================================================== packing */
/* The visited set holds each part of an encoding packed: most of its bytes are zeros (empty
 * block tables, job masks, fences), so each run of 8 bytes becomes a mask byte (bit k: byte
 * k is not zero) followed by its bytes that are not zero. Two byte strings of one length
 * are equal if and only if their packings are. */
#define LOW7 0x7F7F7F7F7F7F7F7Full

static uint8_t nonzero_bytes(uint64_t v) {  /* bit k: byte k of v is not zero */
    uint64_t high = (((v & LOW7) + LOW7) | v) & ~LOW7;
    return (uint8_t)(((high >> 7) * 0x0102040810204080ull) >> 56);
}

/* the packing of `len` bytes into `out` (len + len / 8 + 2 bytes); its length */
int kv_pack(const uint8_t *enc, int len, uint8_t *out) {
    int n = 0;
    for (int i = 0; i < len; i += 8) {
        uint64_t word = 0;
        if (len - i >= 8) memcpy(&word, enc + i, 8);
        else for (int k = 0; k < len - i; k++) word |= (uint64_t)enc[i + k] << (8 * k);
        out[n++] = nonzero_bytes(word);
        if (!word) continue;
        for (int k = 0; k < 8; k++) {  /* each byte written, kept only if not zero */
            uint8_t v = (uint8_t)(word >> (8 * k));
            out[n] = v;
            n += v != 0;
        }
    }
    return n;
}

/* the encoding of a packing of `len` bytes, with zeros after it up to a multiple of 8 bytes
 * (out: ENC_MAX + 8 bytes); kv_decode reads the encoding's own bytes only */
void kv_unpack(const uint8_t *packed, int len, uint8_t *out) {
    for (int n = 0; n < len; out += 8) {
        unsigned mask = packed[n++];
        uint64_t word = 0;
        for (; mask; mask &= mask - 1) word |= (uint64_t)packed[n++] << (8 * __builtin_ctz(mask));
        memcpy(out, &word, 8);
    }
}

/* ============================================================== the visited set */
/* The visited set is collapsed (as SPIN's COLLAPSE mode is: Holzmann, "State compression in
 * SPIN", 1997): each part of an encoding (parts_of) is kept once, packed, in a table of
 * leaves, and a state is the row of its parts' leaf indices, 4 bytes a part. Few parts recur
 * in many states (in store-admission-three-requests, 2.4 million states hold 637 distinct
 * request parts, 3,628 job parts and 24,660 rests), so a state costs its row and not its
 * packing. Two states are equal if and only if their rows are: an encoding's parts are a
 * function of it (each part says its own length), and two parts at one place are equal if
 * and only if their packings are (a part of job records says how many by its first byte).
 * Each table finds its entries by hash in slots of 4 bytes: the entry's index, and as many
 * bits of its hash as the index leaves free (7 in a table of 2^25 slots), so that a probe
 * reads a row only when that tag matches. */
typedef struct {          /* byte strings, each kept once, by index */
    uint8_t *arena;
    size_t used, cap;
    int width;            /* the rows: entry i is `width` bytes at i * width (at: NULL) */
    uint64_t *at;         /* the leaves: entry i's offset in the arena << 16 | its length
                           * (one word: a lookup reads both from one cache line) */
    int64_t n, alloc;
    uint32_t *slots;      /* open addressing, 4 bytes a slot: (index + 1) << tag_bits | the
                           * hash's top tag_bits bits; 0 empty */
    int64_t nslots;       /* 2^k, more than twice the entries: an index + 1 takes k bits */
    int tag_bits;         /* 32 - k: a probe reads an entry only if its tag matches */
} Table;

typedef struct {
    Table leaves;         /* the parts, packed */
    Table rows;           /* the states: row i is state i's leaves */
    int32_t *parent;
    uint8_t *via;         /* the event from the parent: its index among the parent's events
                           * (event_of gives it back) */
    int64_t alloc;        /* the states the arrays above and efirst have room for */
    int edges;            /* whether it keeps the edges (liveness, the stuck pass): efirst and
                           * the edges' arrays are read only then */
    /* edges, in BFS order of their source */
    int32_t *edst;
    uint8_t *eindex;      /* the edge's event: its index among its source's events */
    uint8_t *eclass;      /* its fairness class: the class's bit + 1, 0 for none */
    int64_t *efirst;      /* edges of state i: efirst[i] .. efirst[i + 1] */
    int64_t nedges, ecap;
} Graph;

#define AT_OFFSET(a) ((a) >> 16)
#define AT_LEN(a) ((a) & 0xFFFF)
#define LEAF_UNKNOWN UINT32_MAX  /* in a worker's row: a part not yet in the leaves */

/* the hash a table keys an entry by: 8 bytes a round, mixed, then folded to 32 bits */
static uint32_t hash_bytes(const uint8_t *p, int n) {
    uint64_t h = 0x9E3779B97F4A7C15ull ^ (uint64_t)n;
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        uint64_t v;
        memcpy(&v, p + i, 8);
        h = (h ^ v) * 0xFF51AFD7ED558CCDull;
        h ^= h >> 32;
    }
    uint64_t v = 0;
    memcpy(&v, p + i, (size_t)(n - i));
    h = (h ^ v) * 0xC4CEB9FE1A85EC53ull;
    h ^= h >> 29;
    h *= 0xFF51AFD7ED558CCDull;
    return (uint32_t)(h ^ (h >> 32));
}

/* whether n bytes at a and at b are equal (entries are short: no call into the C library) */
static inline int same_bytes(const uint8_t *a, const uint8_t *b, int n) {
    uint64_t diff = 0;
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        uint64_t u, v;
        memcpy(&u, a + i, 8);
        memcpy(&v, b + i, 8);
        diff |= u ^ v;
    }
    for (; i < n; i++) diff |= (uint64_t)(a[i] ^ b[i]);
    return diff == 0;
}

static int grow(void **p, size_t elem, int64_t count) {
    void *q = realloc(*p, elem * (size_t)count);
    if (!q) return -1;
    *p = q;
    return 0;
}

/* the bits of a hash a slot keeps beside the index, in a table of nslots (a power of two) */
static int tag_bits_for(int64_t nslots) {
    return 32 - __builtin_ctzll((uint64_t)nslots);
}

/* the tag of hash h32: its top tag_bits bits */
static uint32_t tag_of(uint32_t h32, int tag_bits) {
    return tag_bits ? h32 >> (32 - tag_bits) : 0;
}

/* the slot of entry i of hash h32 */
static uint32_t slot_of(int64_t i, uint32_t h32, int tag_bits) {
    return (uint32_t)((uint64_t)(i + 1) << tag_bits) | tag_of(h32, tag_bits);
}

/* a table of `width`-byte entries, or of leaves (width 0), with room for `alloc` of them */
static int table_init(Table *t, int width, int64_t alloc, int64_t nslots) {
    memset(t, 0, sizeof *t);
    t->width = width;
    t->alloc = alloc;
    t->cap = width ? (size_t)(width * alloc) : (size_t)alloc * 64;
    t->nslots = nslots;
    t->tag_bits = tag_bits_for(nslots);
    t->arena = malloc(t->cap);
    t->slots = calloc((size_t)nslots, sizeof *t->slots);
    if (!t->arena || !t->slots) return -1;
    return width ? 0 : grow((void **)&t->at, sizeof *t->at, alloc);
}

static void table_free(Table *t) {
    free(t->arena); free(t->at); free(t->slots);
}

/* entry i of a table, and its length */
static const uint8_t *entry_at(const Table *t, int64_t i, int *len) {
    if (t->width) {
        *len = t->width;
        return t->arena + (size_t)i * (size_t)t->width;
    }
    *len = (int)AT_LEN(t->at[i]);
    return t->arena + AT_OFFSET(t->at[i]);
}

/* the bytes a table holds: its entries, their offsets (leaves) and its slots */
static size_t table_bytes(const Table *t) {
    return t->used + (t->at ? (size_t)t->n * sizeof *t->at : 0) +
           (size_t)t->nslots * sizeof *t->slots;
}

/* the first slot to probe for an entry of hash h32, in a table of nslots (a power of two) */
static int64_t home_slot(uint32_t h32, int64_t nslots) {
    uint64_t h = ((uint64_t)h32 << 32) | h32;
    return (int64_t)((h ^ (h >> 17) * 0x9E3779B97F4A7C15ull) & (uint64_t)(nslots - 1));
}

/* the entries' hashes are computed again from their bytes, a batch at a time: the
 * insertions' cache misses then overlap, as they would not with a hash between each two */
#define REHASH_BATCH 1024

static int rehash(Table *t) {
    int64_t ns = t->nslots * 2;
    if (ns > (1ll << 32)) return -1;  /* an index + 1 would not fit a slot */
    int tag_bits = tag_bits_for(ns);
    uint32_t *slots = calloc((size_t)ns, sizeof *slots);
    if (!slots) return -1;
    uint32_t h32[REHASH_BATCH];
    for (int64_t lo = 0; lo < t->n; lo += REHASH_BATCH) {
        int64_t hi = lo + REHASH_BATCH < t->n ? lo + REHASH_BATCH : t->n;
        for (int64_t i = lo; i < hi; i++) {
            int len;
            const uint8_t *e = entry_at(t, i, &len);
            h32[i - lo] = hash_bytes(e, len);
        }
        for (int64_t i = lo; i < hi; i++) {
            int64_t k = home_slot(h32[i - lo], ns);
            while (slots[k]) k = (k + 1) & (ns - 1);
            slots[k] = slot_of(i, h32[i - lo], tag_bits);
        }
    }
    free(t->slots);
    t->slots = slots;
    t->nslots = ns;
    t->tag_bits = tag_bits;
    return 0;
}

/* the index of the entry `bytes` (its hash h32), or -1 with *slot the empty slot it would
 * take; reads the table only, so workers may call it while no one inserts */
static int64_t probe(const Table *t, const uint8_t *bytes, int len, uint32_t h32, int64_t *slot) {
    int64_t k = home_slot(h32, t->nslots);
    uint32_t tag_mask = (1u << t->tag_bits) - 1, tag = tag_of(h32, t->tag_bits);
    while (t->slots[k]) {
        int64_t i = (int64_t)(t->slots[k] >> t->tag_bits) - 1;
        int n;
        if ((t->slots[k] & tag_mask) == tag) {
            const uint8_t *e = entry_at(t, i, &n);
            if (n == len && same_bytes(e, bytes, len)) return i;
        }
        k = (k + 1) & (t->nslots - 1);
    }
    *slot = k;
    return -1;
}

/* the index of the entry `bytes` (its hash h32), inserting it if new (*fresh = 1); -1 on
 * memory failure */
static int64_t intern(Table *t, const uint8_t *bytes, int len, uint32_t h32, int *fresh) {
    int64_t k = 0;
    int64_t found = probe(t, bytes, len, h32, &k);
    *fresh = 0;
    if (found >= 0) return found;
    if (t->n >= t->alloc) {
        t->alloc *= 2;
        if (t->at && grow((void **)&t->at, sizeof *t->at, t->alloc)) return -1;
    }
    while (t->used + (size_t)len > t->cap) {
        t->cap *= 2;
        if (grow((void **)&t->arena, 1, (int64_t)t->cap)) return -1;
    }
    int64_t i = t->n++;
    memcpy(t->arena + t->used, bytes, (size_t)len);
    if (t->at) t->at[i] = (uint64_t)t->used << 16 | (uint64_t)len;
    t->used += (size_t)len;
    t->slots[k] = slot_of(i, h32, t->tag_bits);
    *fresh = 1;
    if (t->n * 2 > t->nslots && rehash(t)) return -1;
    return i;
}

/* the arrays of a state, for g->alloc states */
static int grow_states(Graph *g) {
    return grow((void **)&g->parent, sizeof *g->parent, g->alloc) ||
           grow((void **)&g->via, sizeof *g->via, g->alloc) ||
           (g->edges && grow((void **)&g->efirst, sizeof *g->efirst, g->alloc + 1));
}

/* the arrays of an edge, for g->ecap edges */
static int grow_edges(Graph *g) {
    return grow((void **)&g->edst, sizeof *g->edst, g->ecap) ||
           grow((void **)&g->eindex, sizeof *g->eindex, g->ecap) ||
           grow((void **)&g->eclass, sizeof *g->eclass, g->ecap);
}

static int graph_init(Graph *g, int nparts, int edges) {
    memset(g, 0, sizeof *g);
    g->edges = edges;
    g->alloc = 1 << 16;
    g->ecap = 1 << 18;
    if (table_init(&g->leaves, 0, 1 << 12, 1 << 13) ||
        table_init(&g->rows, nparts * (int)sizeof(uint32_t), g->alloc, 1 << 17))
        return -1;
    if (grow_states(g) || grow_edges(g)) return -1;
    return 0;
}

static void graph_free(Graph *g) {
    table_free(&g->leaves); table_free(&g->rows);
    free(g->parent); free(g->via);
    free(g->edst); free(g->eindex); free(g->eclass);
    free(g->efirst);
}

/* the number of states the graph holds */
static int64_t states(const Graph *g) { return g->rows.n; }

/* a state as the search holds it: its encoding, where its parts start, their leaves */
typedef struct {
    uint8_t enc[ENC_MAX + 8];  /* kv_unpack writes zeros up to a multiple of 8 bytes after
                                * each part, which the next part's bytes then overwrite */
    int start[MAX_PARTS + 1];
    uint32_t leaf[MAX_PARTS];
} Held;

/* state i as the search holds it (its encoding, its parts' starts and leaves) */
static void held_of(const Graph *g, const Parts *pt, int64_t i, Held *h) {
    int w;
    const uint8_t *row = entry_at(&g->rows, i, &w);
    memcpy(h->leaf, row, (size_t)w);
    h->start[0] = 0;
    for (int p = 0; p < pt->nparts; p++) {
        int len;
        const uint8_t *leaf = entry_at(&g->leaves, h->leaf[p], &len);
        kv_unpack(leaf, len, h->enc + h->start[p]);
        h->start[p + 1] = h->start[p] + part_bytes(pt, p, h->enc + h->start[p]);
    }
}

/* The row of a state's encoding as a worker finds it (a record in its buffer): the leaf of
 * each part, LEAF_UNKNOWN for a part not in the leaves yet, then each such part packed (its
 * length, 2 bytes, its hash, 4, then the packing). The merge interns the unknown parts and
 * then the row (intern_record). */
#define RECORD_MAX (MAX_PARTS * (4 + 2 + 4 + 2) + PACK_MAX)

/* the record of the encoding `enc` into `rec` (its length); *whole: whether the leaves hold
 * all its parts, and then *h32 is its row's hash (look_up finds the state). A part equal to
 * the same part of `from` (the state it was reached from, or NULL) is that part's leaf: an
 * event leaves some parts as they were (of store-admission-three-requests' five, most
 * successors change two or three). Reads the tables only, so workers may call it while no
 * one inserts. */
static int collapse(const Graph *g, const Parts *pt, const uint8_t *enc, const Held *from,
                    uint8_t *rec, int *whole, uint32_t *h32) {
    int start[MAX_PARTS + 1], n = pt->nparts * (int)sizeof(uint32_t), all = 1;
    parts_of(pt, enc, start);
    for (int p = 0; p < pt->nparts; p++) {
        int len = start[p + 1] - start[p];
        if (from && len == from->start[p + 1] - from->start[p] &&
            same_bytes(enc + start[p], from->enc + from->start[p], len)) {
            memcpy(rec + 4 * p, &from->leaf[p], 4);
            continue;
        }
        uint8_t *packed = rec + n + 6;
        int plen = kv_pack(enc + start[p], len, packed);
        uint32_t leaf_hash = hash_bytes(packed, plen);
        int64_t slot, leaf = probe(&g->leaves, packed, plen, leaf_hash, &slot);
        uint32_t id = leaf >= 0 ? (uint32_t)leaf : LEAF_UNKNOWN;
        memcpy(rec + 4 * p, &id, 4);
        if (leaf >= 0) continue;
        all = 0;
        uint16_t l16 = (uint16_t)plen;
        memcpy(rec + n, &l16, 2);
        memcpy(rec + n + 2, &leaf_hash, 4);
        n += 6 + plen;
    }
    *whole = all;
    if (all) *h32 = hash_bytes(rec, g->rows.width);
    return n;
}

/* the state of a whole record (collapse) of row hash h32, or -1 if the visited set does not
 * hold it */
static int64_t look_up(const Graph *g, const uint8_t *rec, uint32_t h32) {
    int64_t slot;
    return probe(&g->rows, rec, g->rows.width, h32, &slot);
}

/* the state of a record (collapse), inserting its parts and its row if new (*fresh = 1); -1
 * on memory failure */
static int64_t intern_record(Graph *g, const uint8_t *rec, int *fresh) {
    int w = g->rows.width;
    uint8_t row[MAX_PARTS * sizeof(uint32_t)];
    memcpy(row, rec, (size_t)w);
    const uint8_t *at = rec + w;
    for (int p = 0; p < w / (int)sizeof(uint32_t); p++) {
        uint32_t id;
        memcpy(&id, row + 4 * p, 4);
        if (id != LEAF_UNKNOWN) continue;
        uint16_t plen;
        uint32_t h32;
        memcpy(&plen, at, 2);
        memcpy(&h32, at + 2, 4);
        int new_leaf;
        int64_t leaf = intern(&g->leaves, at + 6, plen, h32, &new_leaf);
        if (leaf < 0) return -1;
        id = (uint32_t)leaf;
        memcpy(row + 4 * p, &id, 4);
        at += 6 + plen;
    }
    int64_t i = intern(&g->rows, row, w, hash_bytes(row, w), fresh);
    if (i >= 0 && *fresh && states(g) + 1 >= g->alloc) {
        g->alloc *= 2;
        if (grow_states(g)) return -1;
    }
    return i;
}

/* the bytes the explored graph holds: the leaves, the rows, each state's arrays, the hash
 * slots and the edges */
static size_t graph_bytes(const Graph *g) {
    size_t per_state = sizeof *g->parent + sizeof *g->via + (g->edges ? sizeof *g->efirst : 0);
    size_t per_edge = sizeof *g->edst + sizeof *g->eindex + sizeof *g->eclass;
    return table_bytes(&g->leaves) + table_bytes(&g->rows) + (size_t)states(g) * per_state +
           (size_t)g->nedges * per_edge;
}

/* ============================================================== fairness classes */
/* the weakly fair classes of spec/progress.py FAIRNESS, one bit each: an engine step, the
 * admission of request r, the finishing of request r, a worker's report of job j (an ack or
 * a failure; canonical ids). The environment's choices (arrivals, aborts, preemptions,
 * resets, promotions, stray reports of drained stale ids) carry none. */
#define FAIR_BIT_STEP 0
#define FAIR_BIT_ADMIT(r) (1 + (r))
#define FAIR_BIT_FINISH(r) (1 + MAXR + (r))
#define FAIR_BIT_REPORT(j) (1 + 2 * MAXR + (j))
_Static_assert(1 + 2 * MAXR + MAXID <= 64, "fairness classes fit 64 bits");
_Static_assert(N_FAIR == 4 && FAIR_step == 0 && FAIR_admit == 1 && FAIR_finish == 2 &&
               FAIR_report == 3, "the classes of spec/progress.py FAIRNESS");

/* the class of event ev: its bit + 1, or 0 for none (an edge's eclass) */
static uint8_t fair_bit(uint32_t ev) {
    switch (EV_KIND(ev)) {
    case EV_STEP:
        if (EV_PROMOTE(ev)) return 0;
        return (uint8_t)(1 + (EV_ADMIT(ev) ? FAIR_BIT_ADMIT(EV_REQ(ev)) : FAIR_BIT_STEP));
    case EV_FINISH: return (uint8_t)(1 + FAIR_BIT_FINISH(EV_REQ(ev)));
    case EV_REPORT: return (uint8_t)(1 + FAIR_BIT_REPORT(EV_JOB(ev)));
    default: return 0;
    }
}

/* a class of fair_bit as a set of one bit (or none) */
static uint64_t class_set(uint8_t bit) {
    return bit ? 1ull << (bit - 1) : 0;
}

/* the class of edge e */
static uint64_t edge_class(const Graph *g, int64_t e) {
    return class_set(g->eclass[e]);
}

static int add_edge(Graph *g, int64_t dst, uint8_t index, uint8_t klass) {
    if (g->nedges >= g->ecap) {
        g->ecap *= 2;
        if (grow_edges(g)) return -1;
    }
    g->edst[g->nedges] = (int32_t)dst;
    g->eindex[g->nedges] = index;
    g->eclass[g->nedges++] = klass;
    return 0;
}

/* the fairness classes with an edge out of state v (the graph's edges hold every event
 * enabled in v) */
static uint64_t enabled_of(const Graph *g, int64_t v) {
    uint64_t classes = 0;
    for (int64_t e = g->efirst[v]; e < g->efirst[v + 1]; e++) classes |= edge_class(g, e);
    return classes;
}

/* ============================================================== progress predicates */
static int waiting_P_1(const Bounds *b, const State *s, int r) {  /* jobs, fence, quarantine */
    (void)b; (void)r;
    return s->njobs > 0;
}

static int waiting_P_2(const Bounds *b, const State *s, int r) {  /* r waits on the connector */
    (void)b;
    return (s->req[r].flags & RF_TRACKED) && ((RS_WAITING_ON_CONNECTOR >> s->req[r].state) & 1);
}

static int waiting_P_3(const Bounds *b, const State *s, int r) {  /* not quiescent */
    (void)r;
    if (s->njobs) return 1;
    for (int q = 0; q < b->requests; q++)
        if ((s->req[q].flags & RF_TRACKED) && !((RS_QUIESCENT >> s->req[q].state) & 1)) return 1;
    return 0;
}

static int waiting_P_4(const Bounds *b, const State *s, int r) {  /* the core still holds r */
    (void)b;
    return s->req[r].cstatus != C_NONE && s->req[r].cstatus != C_FINISHED;
}

static int waiting_P_5(const Bounds *b, const State *s, int r) {  /* finished, not signaled */
    (void)b;
    const Req *q = &s->req[r];
    return q->cstatus == C_FINISHED && !((q->flags & RF_SIGENTRY) && q->signals > 0);
}

#include "progress.h"

_Static_assert(N_PROPS * MAXR <= 32, "a state's waiting instances fit 32 bits");

/* ============================================================== the result */
typedef struct {
    int64_t states, edges, stuck_states;
    int32_t depth, complete, verdict, invariant, inside_hook, request, nprefix, ncycle;
    int32_t nlive;        /* progress properties checked and found to hold (in order) */
    int32_t threads;      /* the threads that searched */
    int64_t memory;       /* the bytes of the search's data at its peak (graph_bytes, and the
                           * liveness or stuck pass's scratch) */
    double seconds;
    char msg[200];
} Result;

enum { V_OK, V_INVARIANT, V_ILLEGAL, V_LIVENESS, V_STUCK, V_LIMIT, V_MEMORY };

/* ============================================================== the crew */
/* The threads of a search: the caller and up to MAX_THREADS - 1 more. A round runs `task`
 * once on every member (the caller is member 0) and returns when all are done. */
#define MAX_THREADS 64

typedef struct Search Search;
typedef void Task(Search *x, int member);

typedef struct {
    pthread_mutex_t mu;
    pthread_cond_t go, idle;
    uint64_t round;
    int helpers, busy, quit;
    Task *task;
    pthread_t thread[MAX_THREADS];
} Crew;

typedef struct {          /* one member's scratch in a round of expansion */
    Search *x;
    int member;
    struct Succ *succ;
    int64_t nsucc, succ_cap;
    uint8_t *buf;         /* the successors' encodings and the findings' messages */
    size_t used, cap;
    uint64_t *fired;      /* per table row, the first stamp at which it fired here */
    int failed;           /* out of memory */
} Member;

struct Search {
    Bounds b;
    Tables t;
    int32_t *rows;
    int nrows;
    Parts parts;          /* the parts of its encodings */
    Graph g;
    Result r;
    uint32_t *trace;
    int trace_cap;
    /* the run */
    uint32_t faults, without;
    Crew crew;
    Member member[MAX_THREADS];
    int members;
    struct Expansion *exp;    /* the batch's states, in index order */
    int64_t batch_lo, batch_hi, exp_cap;
    atomic_llong next;        /* the next state of the batch (or instance) to take */
    int32_t level;            /* the depth of the states merged now (breadth first) */
    int64_t level_end;        /* the first state of the next depth */
    void *liveness;           /* the liveness pass's shared scratch */
};

static void state_of(Search *x, int64_t i, State *s) {
    Held h;
    held_of(&x->g, &x->parts, i, &h);
    kv_decode(&x->b, h.enc, s);
}

/* the events of state i (kv_events, in its order): the graph keeps an event as its index
 * here, and a trace reads it back */
static int events_of(Search *x, int64_t i, uint32_t *evs) {
    State s;
    state_of(x, i, &s);
    return kv_events(&x->b, &s, evs);
}

static uint32_t event_of(Search *x, int64_t i, uint8_t index) {
    uint32_t evs[MAX_EVENTS];
    events_of(x, i, evs);
    return evs[index];
}

static int path_to(Search *x, int64_t i, uint32_t *out, int cap) {
    int n = 0;
    for (int64_t k = i; k > 0; k = x->g.parent[k]) n++;
    if (n > cap) return -1;
    int at = n;
    for (int64_t k = i; k > 0; k = x->g.parent[k])
        out[--at] = event_of(x, x->g.parent[k], x->g.via[k]);
    return n;
}

/* ============================================================== liveness */
/* spec/liveness.py, in C: the strongly connected components of the `waiting` states; a
 * component with an internal edge in which every class enabled in all of its states is taken
 * on an internal edge holds a fair cycle. An instance is a progress property (and, for a
 * property of each request, a request); one pass over the states computes every instance's
 * `waiting` bit, then the instances are searched independently, on the crew.
 *
 * The components are Tarjan's, found as Pearce finds them ("A space-efficient algorithm for
 * finding strongly connected components", IPL 2016): one number a state, its index while its
 * component is open, the least index it reaches (Tarjan's low link) once visited, and its
 * component's id once closed. The ids count down from RI_TOP, above every index, so a closed
 * state never lowers an open one's number. The depth-first search and so the order in which
 * the components close are Tarjan's. */
#define RI_NONE UINT32_MAX        /* not visited */
#define RI_TOP (UINT32_MAX - 1)   /* the first component's id */
#define IT_ROOT 0x80              /* iter: the state is still its component's root */
_Static_assert(MAX_EVENTS < IT_ROOT, "an edge offset leaves iter's root bit free");

typedef struct {
    uint32_t *rindex;     /* the state's number (above) */
    int32_t *stack;       /* the visited states of open components that are not their root */
    int32_t *call;        /* the depth-first path */
    int32_t *prev, *queue;
    uint8_t *iter;        /* the offset of v's next edge to follow past efirst[v], | IT_ROOT */
    uint8_t *pedge;       /* on a path: the edge to v, its offset past efirst[prev[v]] */
} Tarjan;

/* the id of the first fair component (in Tarjan's order from state 0 up) of the states whose
 * `waiting` holds `bit`, or -1; tj->rindex[v] == id says v is in it */
static int64_t fair_scc(Search *x, const uint32_t *waiting, uint32_t bit, Tarjan *tj) {
    Graph *g = &x->g;
#define bad(v) (waiting[v] & bit)
    int64_t n = states(g), sp = 0;
    uint32_t counter = 0, next_id = RI_TOP;
    uint32_t *ri = tj->rindex;
    for (int64_t v = 0; v < n; v++) ri[v] = RI_NONE;
    int32_t *call = tj->call;
    for (int64_t root = 0; root < n; root++) {
        if (!bad(root) || ri[root] != RI_NONE) continue;
        int64_t depth = 0;
        call[depth++] = (int32_t)root;
        ri[root] = counter++;
        tj->iter[root] = IT_ROOT;
        while (depth) {
            int32_t v = call[depth - 1];
            int64_t e = g->efirst[v] + (tj->iter[v] & ~IT_ROOT);
            if (e < g->efirst[v + 1]) {
                tj->iter[v]++;
                int32_t w = g->edst[e];
                if (!bad(w)) continue;
                if (ri[w] == RI_NONE) {
                    ri[w] = counter++;
                    tj->iter[w] = IT_ROOT;
                    call[depth++] = w;
                } else if (ri[w] < ri[v]) {
                    ri[v] = ri[w];
                    tj->iter[v] &= (uint8_t)~IT_ROOT;
                }
                continue;
            }
            depth--;
            if (!(tj->iter[v] & IT_ROOT)) tj->stack[sp++] = v;
            else {  /* v closes its component: v and the states above it on the stack */
                int64_t first = sp;
                while (first > 0 && ri[tj->stack[first - 1]] >= ri[v]) first--;
                uint32_t id = next_id--;
                ri[v] = id;
                for (int64_t k = first; k < sp; k++) ri[tj->stack[k]] = id;
                uint64_t always = ~0ull, taken = 0;
                int internal = 0;
                for (int64_t k = first - 1; k < sp; k++) {
                    int32_t s = k < first ? v : tj->stack[k];
                    uint64_t enabled = 0;
                    for (int64_t f = g->efirst[s]; f < g->efirst[s + 1]; f++) {
                        uint64_t c = edge_class(g, f);
                        enabled |= c;
                        if (ri[g->edst[f]] == id) { internal = 1; taken |= c; }
                    }
                    always &= enabled;
                }
                sp = first;
                if (internal && !(always & ~taken)) return id;
            }
            if (depth) {
                int32_t u = call[depth - 1];
                if (ri[v] < ri[u]) {
                    ri[u] = ri[v];
                    tj->iter[u] &= (uint8_t)~IT_ROOT;
                }
            }
        }
    }
    return -1;
#undef bad
}

/* the shortest path inside component `id` from `from` that ends in `target` (>= 0), or in a
 * state where class `want` is not enabled, or with an internal edge of class `want`; its
 * edges are appended to the trace. Returns the new length, or -1. */
static int comp_path(Search *x, Tarjan *tj, uint32_t id, int32_t from, int32_t target,
                     uint64_t want, int n, int32_t *end) {
    Graph *g = &x->g;
    int64_t head = 0, tail = 0, last = -1;
    int32_t stop = -1;
    tj->queue[tail++] = from;
    tj->prev[from] = from;
    while (head < tail && stop < 0) {
        int32_t v = tj->queue[head++];
        if (v != from && (v == target || (want && !(enabled_of(g, v) & want)))) { stop = v; break; }
        for (int64_t e = g->efirst[v]; e < g->efirst[v + 1]; e++) {
            int32_t w = g->edst[e];
            if (tj->rindex[w] != id) continue;
            if (want && edge_class(g, e) == want) { stop = v; last = e; break; }
            if (tj->prev[w] >= 0) continue;
            tj->prev[w] = v;
            tj->pedge[w] = (uint8_t)(e - g->efirst[v]);
            tj->queue[tail++] = w;
        }
    }
    if (stop < 0) return -1;
    int len = 0;
    for (int32_t v = stop; v != from; v = tj->prev[v]) len++;
    int total = n + len + (last >= 0);
    if (total > x->trace_cap) return -1;
    int at = n + len;
    for (int32_t v = stop; v != from; v = tj->prev[v]) {
        int32_t u = tj->prev[v];
        x->trace[--at] = event_of(x, u, g->eindex[g->efirst[u] + tj->pedge[v]]);
    }
    for (int64_t k = 0; k < tail; k++) tj->prev[tj->queue[k]] = -1;
    if (last >= 0) { x->trace[n + len] = event_of(x, stop, g->eindex[last]); *end = g->edst[last]; }
    else *end = stop;
    return total;
}

/* the lasso through component `id`: a shortest path to its entry (the member nearest the
 * initial state: the first in breadth-first order), then, from the entry, an edge of each
 * class still owed (enabled in every state visited and not yet taken), then back to the
 * entry */
static int lasso(Search *x, Tarjan *tj, uint32_t id) {
    Graph *g = &x->g;
    int32_t entry = -1;
    for (int64_t v = 0; v < states(g) && entry < 0; v++)
        if (tj->rindex[v] == id) entry = (int32_t)v;
    int n = path_to(x, entry, x->trace, x->trace_cap);
    if (n < 0) return -1;
    x->r.nprefix = n;
    for (int64_t v = 0; v < states(g); v++) tj->prev[v] = -1;
    int start = n;
    int32_t cur = entry;
    uint64_t inter = enabled_of(g, entry), taken = 0;
    for (;;) {
        uint64_t owed = inter & ~taken;
        if (!owed && n > start && cur == entry) break;
        int32_t end = -1;
        int from = n;
        if (owed) n = comp_path(x, tj, id, cur, -1, owed & (~owed + 1), n, &end);
        else if (cur != entry) n = comp_path(x, tj, id, cur, entry, 0, n, &end);
        else {  /* nothing owed yet no edge: one internal edge out of the entry */
            for (int64_t e = g->efirst[entry]; e < g->efirst[entry + 1]; e++)
                if (tj->rindex[g->edst[e]] == id) {
                    if (n >= x->trace_cap) return -1;
                    x->trace[n++] = event_of(x, entry, g->eindex[e]);
                    end = g->edst[e];
                    break;
                }
        }
        if (n < 0 || end < 0) return -1;
        /* replay the appended labels to learn the states visited and the classes taken */
        int32_t v = cur;
        for (int k = from; k < n; k++) {
            uint32_t evs[MAX_EVENTS];
            events_of(x, v, evs);
            int64_t e = g->efirst[v];
            while (e < g->efirst[v + 1] &&
                   !(evs[g->eindex[e]] == x->trace[k] && tj->rindex[g->edst[e]] == id))
                e++;
            if (e == g->efirst[v + 1]) return -1;
            taken |= edge_class(g, e);
            v = g->edst[e];
            inter &= enabled_of(g, v);
        }
        cur = v;
    }
    x->r.ncycle = n - start;
    return 0;
}

typedef struct {
    uint32_t *waiting;        /* per state, bit k: instance k's `waiting` holds */
    _Atomic uint32_t any;     /* the instances waiting in some state */
    int ninst;
    int members;              /* the members that search instances (live_members) */
    int prop[32], req[32];    /* instance k's property and request */
    atomic_int first;         /* the first instance found with a fair cycle (ninst: none) */
    atomic_int nomem;
} Live;

static void tarjan_free(Tarjan *tj) {
    free(tj->rindex); free(tj->stack); free(tj->call);
    free(tj->prev); free(tj->queue); free(tj->iter); free(tj->pedge);
    memset(tj, 0, sizeof *tj);
}

/* the search's arrays; `lasso` also needs the paths' (prev, queue, pedge) */
static int tarjan_alloc(Tarjan *tj, int64_t n, int lasso) {
    memset(tj, 0, sizeof *tj);
    tj->rindex = malloc(sizeof *tj->rindex * (size_t)n);
    tj->stack = malloc(sizeof *tj->stack * (size_t)n);
    tj->call = malloc(sizeof *tj->call * (size_t)(n + 1));
    tj->iter = malloc(sizeof *tj->iter * (size_t)n);
    if (lasso) {
        tj->prev = malloc(sizeof *tj->prev * (size_t)n);
        tj->queue = malloc(sizeof *tj->queue * (size_t)n);
        tj->pedge = malloc(sizeof *tj->pedge * (size_t)n);
    }
    if (tj->rindex && tj->stack && tj->call && tj->iter &&
        (!lasso || (tj->prev && tj->queue && tj->pedge)))
        return 0;
    tarjan_free(tj);
    return -1;
}

/* the search's scratch per state (tarjan_alloc without the paths), and with them */
#define TARJAN_BYTES (3 * sizeof(int32_t) + sizeof(uint8_t))
#define LASSO_BYTES (TARJAN_BYTES + 2 * sizeof(int32_t) + sizeof(uint8_t))

/* the peak of the search's data (Result.memory): the graph and a pass's scratch */
static void note_scratch(Search *x, size_t scratch) {
    int64_t bytes = (int64_t)(graph_bytes(&x->g) + scratch);
    if (bytes > x->r.memory) x->r.memory = bytes;
}

/* the members that search instances side by side: each holds a Tarjan scratch, and together
 * they may take at most as much memory as the explored graph already does */
static int live_members(const Search *x, int ninst) {
    size_t each = TARJAN_BYTES * (size_t)states(&x->g) + 1;
    int64_t k = (int64_t)(graph_bytes(&x->g) / each);
    if (k > x->members) k = x->members;
    if (k > ninst) k = ninst;
    return k < 1 ? 1 : (int)k;
}

static void run_round(Search *x, Task *task);

/* a round: every instance's `waiting` bit in every state, states taken in slices */
static void waiting_task(Search *x, int member) {
    (void)member;
    Live *lv = x->liveness;
    uint32_t any = 0;
    for (;;) {
        int64_t lo = atomic_fetch_add(&x->next, 4096);
        if (lo >= states(&x->g)) break;
        int64_t hi = lo + 4096 < states(&x->g) ? lo + 4096 : states(&x->g);
        for (int64_t v = lo; v < hi; v++) {
            State s;
            state_of(x, v, &s);
            uint32_t m = 0;
            for (int k = 0; k < lv->ninst; k++)
                if (WAITING[lv->prop[k]](&x->b, &s, lv->req[k])) m |= 1u << k;
            lv->waiting[v] = m;
            any |= m;
        }
    }
    atomic_fetch_or(&lv->any, any);
}

/* a round: the instances, in order, each on the member that takes it; an instance after the
 * first one found with a fair cycle is not searched */
static void instance_task(Search *x, int member) {
    Live *lv = x->liveness;
    if (member >= lv->members) return;
    Tarjan tj;
    int ready = 0;
    for (;;) {
        int k = (int)atomic_fetch_add(&x->next, 1);
        if (k >= lv->ninst) break;
        if (k > atomic_load(&lv->first) || !((atomic_load(&lv->any) >> k) & 1)) continue;
        if (!ready) {
            if (tarjan_alloc(&tj, states(&x->g), 0)) { atomic_store(&lv->nomem, 1); break; }
            ready = 1;
        }
        if (fair_scc(x, lv->waiting, 1u << k, &tj) < 0) continue;
        int prev = atomic_load(&lv->first);
        while (k < prev && !atomic_compare_exchange_weak(&lv->first, &prev, k)) {}
    }
    if (ready) tarjan_free(&tj);
}

static void liveness(Search *x) {
    Live lv;
    memset(&lv, 0, sizeof lv);
    for (int prop = 0; prop < N_PROPS; prop++)
        for (int r = 0; r < (PROP_PER_REQUEST[prop] ? x->b.requests : 1); r++) {
            lv.prop[lv.ninst] = prop;
            lv.req[lv.ninst++] = r;
        }
    atomic_init(&lv.first, lv.ninst);
    lv.members = live_members(x, lv.ninst);
    atomic_init(&lv.any, 0);
    atomic_init(&lv.nomem, 0);
    int64_t n = states(&x->g);
    lv.waiting = malloc(sizeof(uint32_t) * (size_t)n);
    if (!lv.waiting) { x->r.verdict = V_MEMORY; return; }
    note_scratch(x, (sizeof *lv.waiting + TARJAN_BYTES * (size_t)lv.members) * (size_t)n);
    x->liveness = &lv;
    atomic_store(&x->next, 0);
    run_round(x, waiting_task);
    atomic_store(&x->next, 0);
    run_round(x, instance_task);
    x->liveness = NULL;
    int k = atomic_load(&lv.first);
    if (atomic_load(&lv.nomem)) x->r.verdict = V_MEMORY;
    else if (k < lv.ninst) {  /* the first instance with a fair cycle, again, for its lasso */
        Tarjan tj;
        note_scratch(x, (sizeof *lv.waiting + LASSO_BYTES) * (size_t)n);
        int64_t id = tarjan_alloc(&tj, n, 1) ? -1 : fair_scc(x, lv.waiting, 1u << k, &tj);
        x->r.verdict = V_LIVENESS;
        x->r.invariant = lv.prop[k];
        x->r.request = PROP_PER_REQUEST[lv.prop[k]] ? lv.req[k] : -1;
        x->r.nlive = lv.prop[k];
        if (id < 0 || lasso(x, &tj, (uint32_t)id)) x->r.verdict = V_MEMORY;
        tarjan_free(&tj);
    } else x->r.nlive = N_PROPS;
    free(lv.waiting);
}

/* the old progress check: a quiescent state reachable from every state */
static void stuck(Search *x) {
    Graph *g = &x->g;
    int64_t n = states(g);
    uint8_t *good = calloc((size_t)n, 1);
    int64_t *rfirst = calloc((size_t)n + 1, sizeof(int64_t));
    int32_t *rsrc = malloc(sizeof(int32_t) * (size_t)(g->nedges + 1));
    int32_t *queue = malloc(sizeof(int32_t) * (size_t)(n + 1));
    if (!good || !rfirst || !rsrc || !queue) { x->r.verdict = V_MEMORY; goto done; }
    for (int64_t e = 0; e < g->nedges; e++) rfirst[g->edst[e] + 1]++;
    for (int64_t v = 0; v < n; v++) rfirst[v + 1] += rfirst[v];
    int64_t *fill = malloc(sizeof(int64_t) * (size_t)(n + 1));
    if (!fill) { x->r.verdict = V_MEMORY; goto done; }
    memcpy(fill, rfirst, sizeof(int64_t) * (size_t)(n + 1));
    note_scratch(x, (sizeof *good + sizeof *rfirst + sizeof *queue + sizeof *fill) *
                        (size_t)(n + 1) + sizeof *rsrc * (size_t)(g->nedges + 1));
    for (int64_t v = 0; v < n; v++)
        for (int64_t e = g->efirst[v]; e < g->efirst[v + 1]; e++) rsrc[fill[g->edst[e]]++] = (int32_t)v;
    free(fill);
    int64_t head = 0, tail = 0;
    for (int64_t v = 0; v < n; v++) {
        State s;
        state_of(x, v, &s);
        int q = s.njobs == 0;
        for (int r = 0; r < x->b.requests && q; r++)
            if ((s.req[r].flags & RF_TRACKED) && !((RS_QUIESCENT >> s.req[r].state) & 1)) q = 0;
        if (q) { good[v] = 1; queue[tail++] = (int32_t)v; }
    }
    while (head < tail) {
        int32_t v = queue[head++];
        for (int64_t e = rfirst[v]; e < rfirst[v + 1]; e++)
            if (!good[rsrc[e]]) { good[rsrc[e]] = 1; queue[tail++] = rsrc[e]; }
    }
    int64_t first = -1;
    for (int64_t v = 0; v < n; v++)
        if (!good[v]) { x->r.stuck_states++; if (first < 0) first = v; }
    if (first >= 0) {
        x->r.verdict = V_STUCK;
        int k = path_to(x, first, x->trace, x->trace_cap);
        x->r.nprefix = k < 0 ? 0 : k;
    }
done:
    free(good); free(rfirst); free(rsrc); free(queue);
}

/* ============================================================== the search */
/* Breadth first, in batches: a batch is the next states in index order (all known when it
 * starts). The crew expands a batch in parallel: each enabled event applied, its successor
 * made canonical, encoded and looked up in the visited set (which no one writes during the
 * round), and, when not found there, checked against every invariant. Then the caller
 * merges the batch alone, state by state and event by event, in the order a search of one
 * thread meets them: new states are numbered, parents, edges and fairness classes recorded,
 * and the first finding in that order stops the search. Coverage is kept the same way: a
 * row counts if it fired at or before the stamp (state index, event) where the search
 * stopped. So every figure, verdict and counterexample is the same for any number of
 * threads. */
typedef void Progress(int64_t states, int64_t edges, int32_t depth);

#define BATCH 1024        /* states a batch, per thread */
#define SLICE 16          /* states a member takes at a time */
#define STAMP(i, k) ((uint64_t)(i) << 8 | (uint64_t)(k))
#define NEVER UINT64_MAX  /* a row not fired */
#define ALL (NEVER - 1)   /* the stop of a search that ran to its end */

typedef struct Succ {     /* an enabled event of a batch's state, as a member found it */
    uint32_t ev;
    uint8_t index;        /* the event's index among the state's events (its stamp) */
    uint8_t klass;        /* its fairness class (fair_bit), for its edge */
    int8_t rc, inside_inv, hook, inv;  /* inv: the invariant its successor breaks, -1 none */
    int64_t known;        /* the successor's index if it was in the visited set, else -1 */
    int64_t at;           /* in the member's buffer: the successor's record (collapse), or a
                           * finding's message */
} Succ;

typedef struct Expansion {  /* a batch's state: its events in member `member`'s list */
    int32_t member, count;
    int64_t first;
} Expansion;

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void *crew_main(void *arg) {
    Member *m = arg;
    Crew *c = &m->x->crew;
    uint64_t seen = 0;
    for (;;) {
        pthread_mutex_lock(&c->mu);
        while (c->round == seen && !c->quit) pthread_cond_wait(&c->go, &c->mu);
        if (c->quit) { pthread_mutex_unlock(&c->mu); return NULL; }
        seen = c->round;
        Task *task = c->task;
        pthread_mutex_unlock(&c->mu);
        task(m->x, m->member);
        pthread_mutex_lock(&c->mu);
        if (--c->busy == 0) pthread_cond_signal(&c->idle);
        pthread_mutex_unlock(&c->mu);
    }
}

static void run_round(Search *x, Task *task) {
    Crew *c = &x->crew;
    if (c->helpers) {
        pthread_mutex_lock(&c->mu);
        c->task = task;
        c->busy = c->helpers;
        c->round++;
        pthread_cond_broadcast(&c->go);
        pthread_mutex_unlock(&c->mu);
    }
    task(x, 0);
    if (c->helpers) {
        pthread_mutex_lock(&c->mu);
        while (c->busy) pthread_cond_wait(&c->idle, &c->mu);
        pthread_mutex_unlock(&c->mu);
    }
}

/* the caller and up to threads - 1 helpers (fewer if the system gives fewer) */
static void crew_start(Search *x, int threads) {
    Crew *c = &x->crew;
    memset(c, 0, sizeof *c);
    pthread_mutex_init(&c->mu, NULL);
    pthread_cond_init(&c->go, NULL);
    pthread_cond_init(&c->idle, NULL);
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    x->members = 1;
    for (int k = 1; k < threads; k++) {
        x->member[k].x = x;
        x->member[k].member = k;
        if (pthread_create(&c->thread[k], NULL, crew_main, &x->member[k])) break;
        c->helpers = x->members++;
    }
    x->member[0].x = x;
    x->member[0].member = 0;
}

static void crew_stop(Search *x) {
    Crew *c = &x->crew;
    pthread_mutex_lock(&c->mu);
    c->quit = 1;
    pthread_cond_broadcast(&c->go);
    pthread_mutex_unlock(&c->mu);
    for (int k = 1; k <= c->helpers; k++) pthread_join(c->thread[k], NULL);
    pthread_mutex_destroy(&c->mu);
    pthread_cond_destroy(&c->go);
    pthread_cond_destroy(&c->idle);
    for (int k = 0; k < x->members; k++) {
        free(x->member[k].succ); free(x->member[k].buf); free(x->member[k].fired);
    }
    memset(x->member, 0, sizeof x->member);
}

static int reserve(Member *m, size_t bytes) {
    if (m->nsucc >= m->succ_cap) {
        m->succ_cap = m->succ_cap ? 2 * m->succ_cap : 1 << 12;
        if (grow((void **)&m->succ, sizeof(Succ), m->succ_cap)) return -1;
    }
    while (m->used + bytes > m->cap) {
        m->cap = m->cap ? 2 * m->cap : 1 << 20;
        if (grow((void **)&m->buf, 1, (int64_t)m->cap)) return -1;
    }
    return 0;
}

/* A successor a member has made but not yet looked up: the look-up of each overlaps the
 * making of the next, while the slot it will read is fetched (a look-up waits on memory). */
typedef struct {
    int64_t succ;         /* its index in the member's list, -1 for none */
    int whole;            /* collapse's answers */
    uint32_t h32;
    const State *state;
} Unsettled;

/* the successor not yet looked up, looked up; its invariants checked if it is new */
static void settle(Search *x, Member *m, Unsettled *w) {
    if (w->succ < 0) return;
    Succ *u = &m->succ[w->succ];
    u->known = w->whole ? look_up(&x->g, m->buf + u->at, w->h32) : -1;
    if (u->known < 0) u->inv = (int8_t)kv_check_invariants(&x->b, w->state, 0, x->without);
    w->succ = -1;
}

/* a round: the members take the batch's states a slice at a time */
static void expand_task(Search *x, int member) {
    Member *m = &x->member[member];
    m->nsucc = 0;
    m->used = 0;
    State s, made[2];     /* the successor made now, and the one not yet looked up */
    int now = 0;
    Unsettled unsettled = {.succ = -1};
    Held from;
    uint32_t evs[MAX_EVENTS];
    uint8_t enc[ENC_MAX];
    char msg[200];
    for (;;) {
        int64_t lo = atomic_fetch_add(&x->next, SLICE);
        if (lo >= x->batch_hi || m->failed) break;
        int64_t hi = lo + SLICE < x->batch_hi ? lo + SLICE : x->batch_hi;
        for (int64_t i = lo; i < hi; i++) {
            Expansion *e = &x->exp[i - x->batch_lo];
            e->member = member;
            e->first = m->nsucc;
            held_of(&x->g, &x->parts, i, &from);
            kv_decode(&x->b, from.enc, &s);
            int n = kv_events(&x->b, &s, evs);
            for (int k = 0; k < n; k++) {
                int inside_inv = -1, hook = -1;
                State *nxt = &made[now];
                int rc = kv_apply(&x->b, &x->t, x->faults, &s, evs[k], nxt, m->fired,
                                  STAMP(i, k), 1, x->without, &inside_inv, &hook, msg);
                if (rc == ERR_NOT_ENABLED) continue;
                if (reserve(m, RECORD_MAX)) { m->failed = 1; break; }
                Succ *u = &m->succ[m->nsucc++];
                u->ev = evs[k];
                u->index = (uint8_t)k;
                u->klass = fair_bit(evs[k]);
                u->rc = (int8_t)rc;
                u->inside_inv = (int8_t)inside_inv;
                u->hook = (int8_t)hook;
                u->inv = -1;
                u->known = -1;
                u->at = (int64_t)m->used;
                if (rc != ERR_NONE) {
                    memcpy(m->buf + m->used, msg, sizeof msg);
                    m->used += sizeof msg;
                    continue;
                }
                if (inside_inv >= 0) continue;
                kv_canonical(nxt);
                kv_encode(&x->b, nxt, enc);
                int whole;
                uint32_t h32 = 0;
                int len = collapse(&x->g, &x->parts, enc, &from, m->buf + m->used, &whole, &h32);
                m->used += (size_t)len;
                if (whole)
                    __builtin_prefetch(&x->g.rows.slots[home_slot(h32, x->g.rows.nslots)]);
                settle(x, m, &unsettled);
                unsettled = (Unsettled){m->nsucc - 1, whole, h32, nxt};
                now ^= 1;
            }
            e->count = (int32_t)(m->nsucc - e->first);
        }
    }
    settle(x, m, &unsettled);
}

/* the rows fired at or before `stop`, over every member */
static void coverage_of(Search *x, uint64_t stop, uint8_t *coverage) {
    for (int row = 0; row < x->nrows; row++) {
        coverage[row] = 0;
        for (int k = 0; k < x->members; k++)
            if (x->member[k].fired && x->member[k].fired[row] <= stop) coverage[row] = 1;
    }
}

void *kv_search_new(const Bounds *b, const int32_t *rows, int nrows, int trace_cap) {
    Search *x = calloc(1, sizeof(Search));
    if (!x) return NULL;
    x->b = *b;
    x->nrows = nrows;
    x->rows = malloc(sizeof(int32_t) * (size_t)(nrows * ROW_WIDTH));
    x->trace = malloc(sizeof(uint32_t) * (size_t)trace_cap);
    x->trace_cap = trace_cap;
    x->parts = parts_for(b);
    if (!x->rows || !x->trace) return NULL;
    memcpy(x->rows, rows, sizeof(int32_t) * (size_t)(nrows * ROW_WIDTH));
    if (kv_tables_init(&x->t, x->rows, nrows)) return NULL;
    return x;
}

void kv_search_free(void *h) {
    Search *x = h;
    if (!x) return;
    kv_tables_free(&x->t);
    graph_free(&x->g);
    free(x->rows);
    free(x->trace);
    free(x->exp);
    free(x);
}

const uint32_t *kv_search_trace(void *h) { return ((Search *)h)->trace; }

/* state i's encoding (its parts unpacked, decoded and encoded again: its own length) */
int kv_search_state(void *h, int64_t i, uint8_t *out) {
    Search *x = h;
    if (i < 0 || i >= states(&x->g)) return -1;
    State s;
    state_of(x, i, &s);
    return kv_encode(&x->b, &s, out);
}

int64_t kv_search_parent(void *h, int64_t i) { return ((Search *)h)->g.parent[i]; }

/* merges the expansion of state i (see the search); 1: the search stops at *stop */
static int merge(Search *x, int64_t i, Progress *progress, uint64_t *stop) {
    Graph *g = &x->g;
    Result *r = &x->r;
    const Expansion *e = &x->exp[i - x->batch_lo];
    const Member *m = &x->member[e->member];
    if (i == x->level_end) {  /* i is the first state of the next level: every state of that
                                 * level is known, and none after it */
        x->level++;
        x->level_end = states(g);
    }
    if (g->edges) g->efirst[i] = g->nedges;
    for (int32_t k = 0; k < e->count; k++) {
        const Succ *u = &m->succ[e->first + k];
        *stop = STAMP(i, u->index);
        r->edges++;
        if (u->rc == ERR_LIMIT || u->rc == ERR_MODEL || u->inside_inv >= 0) {
            if (u->rc != ERR_NONE) memcpy(r->msg, m->buf + u->at, sizeof r->msg);
            if (u->rc == ERR_LIMIT) { r->verdict = V_LIMIT; return 1; }
            int len = path_to(x, i, x->trace, x->trace_cap - 1);
            x->trace[len++] = u->ev;
            r->nprefix = len;
            r->verdict = u->rc == ERR_MODEL ? V_ILLEGAL : V_INVARIANT;
            r->invariant = u->inside_inv;
            r->inside_hook = u->rc == ERR_MODEL ? -1 : u->hook;
            return 1;
        }
        int fresh = 0;
        int64_t j = u->known >= 0 ? u->known : intern_record(g, m->buf + u->at, &fresh);
        if (j < 0) { r->verdict = V_MEMORY; return 1; }
        if (fresh) {
            g->parent[j] = (int32_t)i;
            g->via[j] = u->index;
            r->depth = x->level + 1;
            if (u->inv >= 0) {
                r->verdict = V_INVARIANT;
                r->invariant = u->inv;
                r->nprefix = path_to(x, j, x->trace, x->trace_cap);
                return 1;
            }
            if (progress && (j & 0xFFFF) == 0) progress(states(g), r->edges, r->depth);
        }
        if (g->edges && add_edge(g, j, u->index, u->klass)) { r->verdict = V_MEMORY; return 1; }
    }
    if (g->edges) g->efirst[i + 1] = g->nedges;
    *stop = STAMP(i, 0xFF);
    return 0;
}

int kv_search_run(void *h, uint32_t faults, uint32_t without, int64_t max_states, int do_liveness,
                  int do_stuck, int threads, uint8_t *coverage, Progress *progress, Result *out) {
    Search *x = h;
    Graph *g = &x->g;
    Result *r = &x->r;
    memset(r, 0, sizeof *r);
    r->complete = 1;
    r->request = -1;
    r->inside_hook = -1;
    x->faults = faults;
    x->without = without;
    double t0 = now();
    uint64_t stop = ALL;
    /* out of memory before the crew starts: nothing to stop */
    if (graph_init(g, x->parts.nparts, do_liveness || do_stuck)) {
        r->verdict = V_MEMORY;
        *out = *r;
        return 0;
    }
    crew_start(x, threads < 1 ? 1 : threads);
    r->threads = x->members;
    for (int k = 0; k < x->members; k++) {
        Member *m = &x->member[k];
        m->fired = malloc(sizeof(uint64_t) * (size_t)(x->nrows ? x->nrows : 1));
        if (!m->fired) { r->verdict = V_MEMORY; goto out; }
        for (int row = 0; row < x->nrows; row++) m->fired[row] = NEVER;
    }
    x->exp_cap = (int64_t)BATCH * x->members;
    if (grow((void **)&x->exp, sizeof(Expansion), x->exp_cap)) { r->verdict = V_MEMORY; goto out; }
    State s;
    uint8_t enc[ENC_MAX], rec[RECORD_MAX];
    kv_initial(&x->b, &s);
    kv_canonical(&s);
    int whole, fresh;
    uint32_t h32;
    kv_encode(&x->b, &s, enc);
    collapse(g, &x->parts, enc, NULL, rec, &whole, &h32);
    if (intern_record(g, rec, &fresh) < 0) { r->verdict = V_MEMORY; goto out; }
    g->parent[0] = -1;
    g->via[0] = 0;
    x->level = 0;
    x->level_end = 1;
    int inv = kv_check_invariants(&x->b, &s, 0, without);
    if (inv >= 0) { r->verdict = V_INVARIANT; r->invariant = inv; stop = 0; goto out; }
    for (int64_t lo = 0; lo < states(g);) {
        x->batch_lo = lo;
        x->batch_hi = lo + x->exp_cap < states(g) ? lo + x->exp_cap : states(g);
        atomic_store(&x->next, lo);
        run_round(x, expand_task);
        for (int k = 0; k < x->members; k++)
            if (x->member[k].failed) { r->verdict = V_MEMORY; goto out; }
        for (int64_t i = lo; i < x->batch_hi; i++) {
            if (merge(x, i, progress, &stop)) goto out;
            if (max_states > 0 && states(g) >= max_states) { r->complete = 0; goto searched; }
        }
        lo = x->batch_hi;
    }
    stop = ALL;
searched:
    if (r->complete && do_liveness) liveness(x);
    if (r->complete && do_stuck && r->verdict == V_OK) stuck(x);
out:
    note_scratch(x, 0);
    if (coverage) coverage_of(x, stop, coverage);
    crew_stop(x);
    r->states = states(g);
    r->seconds = now() - t0;
    *out = *r;
    return 0;
}

/* one event on an encoded state, for the differential tests: the encoded canonical
 * successor (its length), or -(1 + error) */
int kv_step(const Bounds *b, const int32_t *rows, int nrows, uint32_t faults, const uint8_t *enc,
            uint32_t ev, uint8_t *out) {
    Tables t;
    if (kv_tables_init(&t, rows, nrows)) return -100;
    State s, nxt;
    kv_decode(b, enc, &s);
    char msg[200];
    int rc = kv_apply(b, &t, faults, &s, ev, &nxt, NULL, 0, 0, 0, NULL, NULL, msg);
    kv_tables_free(&t);
    if (rc) return -(1 + rc);
    kv_canonical(&nxt);
    return kv_encode(b, &nxt, out);
}

int kv_events_of(const Bounds *b, const uint8_t *enc, uint32_t *out) {
    State s;
    kv_decode(b, enc, &s);
    return kv_events(b, &s, out);
}

int kv_encode_initial(const Bounds *b, uint8_t *out) {
    State s;
    kv_initial(b, &s);
    kv_canonical(&s);
    return kv_encode(b, &s, out);
}

int kv_waiting(const Bounds *b, const uint8_t *enc, int prop, int r) {
    State s;
    kv_decode(b, enc, &s);
    return prop >= 0 && prop < N_PROPS ? WAITING[prop](b, &s, r) : -1;
}

uint64_t kv_fair_class(uint32_t ev) { return class_set(fair_bit(ev)); }
