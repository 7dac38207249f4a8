/* spec/invariants.py in C, on the model state as spec.model.projection.abstract sees it:
 * the requests are the tracked ones; the job table is the records not held; the reset fence
 * the held STALE ones, the quarantine the held TIMED_OUT ones. Returns the number of the
 * first invariant broken (in spec.invariants.SAFETY order: INV-1 .. INV-12, INV-15 ..
 * INV-24), or -1. The Python checker states the violation
 * in words when it replays. */
#include "model.h"

#define IN(group, state) (((group) >> (state)) & 1)
#define ON(n) (!((without >> ((n) - 1)) & 1))

static int live(const Job *j) { return (j->flags & JF_TABLE) != 0; }
/* the reset fence and the timeout quarantine as spec.model.projection.abstract sees them */
static int fenced(const Job *j) { return (j->flags & JF_HELD) && j->state == J_STALE; }
static int quarantined(const Job *j) { return (j->flags & JF_HELD) && j->state == J_TIMED_OUT; }
static int tracked(const Req *q) { return (q->flags & RF_TRACKED) != 0; }

static const Job *find(const State *s, int id) {
    for (int i = 0; i < s->njobs; i++)
        if (s->job[i].id == id) return &s->job[i];
    return NULL;
}

/* projection._held: the blocks of the request's table it still holds (no null block, no
 * window position before the window of its computed tokens), as a mask */
static uint16_t held_blocks(const Bounds *b, const Req *q) {
    /* the connector's table once the core scheduled the request; until then (loading, its
     * table empty since the lookup) the core's */
    const uint8_t *t = q->nblocks ? q->blocks : q->cblocks;
    int nt = q->nblocks ? q->nblocks : q->ncblocks;
    uint16_t m = 0;
    for (int i = 0; i < nt; i++)
        if (t[i] != NONE8 && !kv_freed_position(b, nt, i, q->window_end)) m |= (uint16_t)(1u << t[i]);
    return m;
}

/* the request's gpu_blocks in the abstract state, as a mask, plus their sequence length */
static uint16_t gpu_blocks(const Bounds *b, const State *s, int r, uint8_t *seq, int *n) {
    const Req *q = &s->req[r];
    uint16_t m = 0, still = held_blocks(b, q);
    *n = 0;
    if (IN(RS_HOLDS_GPU_BLOCKS, q->state)) {
        for (int blk = 0; blk < MAXB; blk++)
            if ((still >> blk) & 1) seq[(*n)++] = (uint8_t)blk;
        m = still;
    } else if (q->flags & RF_FINISHED) {
        for (int i = 0; i < s->njobs; i++) {
            const Job *j = &s->job[i];
            /* an async load's destinations (spec.request.finished_keeps_destinations), but
             * not those a sliding window left behind while the request ran */
            if (live(j) && j->owner == r && j->kind == KIND_LOAD && !(j->flags & JF_SYNC))
                for (int k = 0; k < j->nblocks && *n < 2 * MAXT; k++) {
                    if (!((still >> j->blocks[k]) & 1)) continue;
                    seq[(*n)++] = j->blocks[k];
                    m |= (uint16_t)(1u << j->blocks[k]);
                }
        }
    }
    return m;
}

int kv_check_invariants(const Bounds *b, const State *s, int step_open, uint32_t without) {
    int R = b->requests;
    uint32_t live_ids = 0;
    for (int i = 0; i < s->njobs; i++)
        if (live(&s->job[i])) live_ids |= 1u << s->job[i].id;

    /* INV-1 jobs-in-table */
    if (ON(1))
        for (int r = 0; r < R; r++)
            if (tracked(&s->req[r]) && (s->req[r].jobs & ~live_ids)) return 1;
    /* INV-2 table-owned */
    if (ON(2))
        for (int i = 0; i < s->njobs; i++) {
            const Job *j = &s->job[i];
            if (!live(j)) continue;
            const Req *o = &s->req[j->owner];
            if (!tracked(o) || !((o->jobs >> j->id) & 1)) return 2;
        }
    /* INV-3 disjoint-ownership */
    if (ON(3)) {
        uint32_t seen = 0;
        for (int r = 0; r < R; r++) {
            if (!tracked(&s->req[r])) continue;
            if (seen & s->req[r].jobs) return 3;
            seen |= s->req[r].jobs;
        }
    }
    /* INV-4 stale-threshold */
    if (ON(4)) {
        if (s->threshold > s->counter) return 4;
        for (int i = 0; i < s->njobs; i++) {
            const Job *j = &s->job[i];
            if (live(j) && !(s->threshold <= j->id && j->id < s->counter)) return 4;
            if (fenced(j) && !(j->id < s->threshold)) return 4;
        }
    }
    /* INV-5 pending-bounds */
    if (ON(5))
        for (int i = 0; i < s->njobs; i++) {
            const Job *j = &s->job[i];
            int records = live(j) + fenced(j) + quarantined(j);
            if (records && !(1 <= j->pending && j->pending <= b->workers)) return 5;
        }
    /* INV-6 load-exclusive */
    if (ON(6))
        for (int r = 0; r < R; r++) {
            const Req *q = &s->req[r];
            if (!tracked(q)) continue;
            int loads = 0, async = 0;
            EACH_BIT(id, q->jobs) {
                const Job *j = find(s, (int)id);
                if (j && live(j) && j->kind == KIND_LOAD) {
                    loads++;
                    if (!(j->flags & JF_SYNC)) async = 1;
                }
            }
            if (loads > 1) return 6;
            if (async && __builtin_popcount(q->jobs) > 1) return 6;
        }
    /* INV-7 block-fence */
    if (ON(7)) {
        for (int blk = 0; blk < MAXB; blk++) {
            EACH_BIT(id, s->block_fence[blk]) {
                const Job *j = find(s, (int)id);
                if (!j || !live(j) || j->kind != KIND_STORE) return 7;
                if (!(((j->deferred | j->fenced) >> blk) & 1)) return 7;
            }
        }
        for (int i = 0; i < s->njobs; i++) {
            const Job *j = &s->job[i];
            if (!live(j)) continue;
            const Req *o = &s->req[j->owner];
            uint16_t must = j->fenced;  /* and, once its owner finished, the deferred ones */
            if (tracked(o) && (o->flags & RF_FINISHED)) must |= j->deferred;
            EACH_BIT(blk, must)
                if (!((s->block_fence[blk] >> j->id) & 1)) return 7;
        }
    }
    /* INV-8 chunks-being-loaded */
    if (ON(8)) {
        KeyMask async_keys = 0;
        for (int i = 0; i < s->njobs; i++) {
            const Job *j = &s->job[i];
            if (live(j) && j->kind == KIND_LOAD && !(j->flags & JF_SYNC)) {
                async_keys |= j->keys;
                if (j->keys & ~s->being_loaded) return 8;
            }
        }
        if (s->being_loaded & ~async_keys) return 8;
    }
    /* INV-9 step-scoped */
    if (ON(9) && !step_open) {
        for (int i = 0; i < s->njobs; i++)
            if (live(&s->job[i]) && s->job[i].state == J_CREATED) return 9;
        if (s->to_flush && !s->reset_since_step) return 9;
    }
    /* INV-10 finished-signaled */
    if (ON(10))
        for (int r = 0; r < R; r++) {
            const Req *q = &s->req[r];
            if (!tracked(q)) continue;
            int finished = (q->flags & RF_FINISHED) != 0, signaled = (q->flags & RF_SIGNALED) != 0;
            if (signaled && !finished) return 10;
            if (signaled && !q->jobs) return 10;
            if (finished != (int)IN(RS_FINISHED, q->state)) return 10;
        }
    /* INV-11 finish-once */
    if (ON(11))
        for (int r = 0; r < R; r++)
            if (s->req[r].signals > 1 || s->req[r].after_signal) return 11;
    /* INV-12 manager-pins */
    if (ON(12)) {
        int readers[MAXK] = {0};
        for (int i = 0; i < s->njobs; i++) {
            const Job *j = &s->job[i];
            int counted = live(j) + quarantined(j);
            if (counted && j->kind == KIND_LOAD)
                EACH_BIT(k, j->keys) readers[k]++;
        }
        for (int i = 0; i < s->njobs; i++) {
            const Job *j = &s->job[i];
            if (live(j) && j->kind == KIND_STORE && !(j->flags & JF_FAILED))
                EACH_BIT(k, j->keys)
                    if (s->chunk[k] != -1) return 12;
        }
        for (int k = 0; k < MAXK; k++) {
            int8_t ref = s->chunk[k];
            if (ref != CH_ABSENT && ref >= 0 && ref != readers[k]) return 12;
            if (readers[k] && (ref == CH_ABSENT || ref < readers[k])) return 12;
        }
    }
    /* INV-15 gpu-data-safety */
    if (ON(15)) {
        int owner_of[MAXB];
        for (int blk = 0; blk < MAXB; blk++) owner_of[blk] = -1;
        for (int r = 0; r < R; r++) {
            if (!tracked(&s->req[r])) continue;
            uint8_t seq[2 * MAXT];
            int n;
            gpu_blocks(b, s, r, seq, &n);
            for (int i = 0; i < n; i++) owner_of[seq[i]] = r;
        }
        for (int i = 0; i < s->njobs; i++) {
            const Job *j = &s->job[i];
            if (!live(j)) continue;
            int flushed = (j->flags & JF_FLUSH_REQ) != 0;
            for (int k = 0; k < j->nblocks; k++) {
                int blk = j->blocks[k], holder = owner_of[blk];
                if (j->kind == KIND_LOAD) {
                    int age = j->age == NONE8 ? 0 : j->age;
                    int done = (j->flags & JF_SYNC) && age >= 1;
                    if (holder != j->owner && !flushed && !done && !step_open) return 15;
                    continue;
                }
                if (holder == j->owner || flushed || (j->flags & JF_FAILED)) continue;
                if (step_open) continue;
                if (!((s->block_fence[blk] >> j->id) & 1)) return 15;
                if (holder >= 0) return 15;
            }
        }
        for (int i = 0; i < s->njobs; i++) {  /* a timed-out load may still write its blocks */
            const Job *j = &s->job[i];
            if (quarantined(j) && j->kind == KIND_LOAD && !(j->flags & JF_SYNC))
                for (int k = 0; k < j->nblocks; k++)
                    if (owner_of[j->blocks[k]] >= 0) return 15;
        }
    }
    /* INV-16 cpu-data-safety */
    if (ON(16)) {
        KeyMask written = 0;
        for (int i = 0; i < s->njobs; i++) {
            const Job *j = &s->job[i];
            if (!live(j) || j->kind != KIND_STORE) continue;
            if (written & j->keys) return 16;
            written |= j->keys;
        }
        for (int i = 0; i < s->njobs; i++) {
            const Job *j = &s->job[i];
            if (live(j) && j->kind == KIND_LOAD && (j->keys & written)) return 16;
        }
        for (int i = 0; i < s->njobs; i++) {
            const Job *j = &s->job[i];
            if (fenced(j) && !(j->flags & JF_FLUSH_SHIPPED) &&
                !((s->to_flush >> j->id) & 1))
                return 16;
        }
    }
    /* INV-17 unique-ids: a record in the table and in the fence or quarantine at once (only
     * a broken table makes one); ids below the counter */
    if (ON(17))
        for (int i = 0; i < s->njobs; i++) {
            const Job *j = &s->job[i];
            if (live(j) + fenced(j) + quarantined(j) > 1) return 17;
            if ((live(j) || fenced(j) || quarantined(j)) && j->id >= s->counter) return 17;
        }
    /* INV-18 hit-pinned-in-step */
    if (ON(18) && !step_open)
        for (int r = 0; r < R; r++)
            if (tracked(&s->req[r]) && (s->req[r].flags & RF_HIT)) return 18;
    /* INV-19 invalid-kv-unpublished */
    if (ON(19))
        for (int r = 0; r < R; r++) {
            const Req *q = &s->req[r];
            if (!tracked(q) || !(q->flags & RF_LOAD_INVALID)) continue;
            EACH_BIT(id, q->jobs) {
                const Job *j = find(s, (int)id);
                if (j && live(j) && j->kind == KIND_STORE && !(j->flags & JF_FAILED)) return 19;
            }
        }
    /* INV-20 valid-kv-published */
    if (ON(20))
        EACH_BIT(k, s->bad_chunks)
            if (s->chunk[k] != CH_ABSENT && s->chunk[k] >= 0) return 20;
    /* INV-21 store-cursor-reset */
    if (ON(21) && s->reset_since_step && !step_open)
        for (int r = 0; r < R; r++)
            if (tracked(&s->req[r]) && s->req[r].cursor != 0) return 21;
    /* INV-22 copy-placement */
    if (ON(22) && s->misplaced) return 22;
    /* INV-23 loads-read-written-blocks */
    if (ON(23) && s->unwritten) return 23;
    /* INV-24 state-holds-jobs */
    if (ON(24))
        for (int r = 0; r < R; r++) {
            const Req *q = &s->req[r];
            if (!tracked(q)) continue;
            if (IN(RS_HOLDS_JOBS, q->state) && !q->jobs) return 24;
            if (!IN(RS_MAY_HOLD_JOBS, q->state) && q->jobs) return 24;
        }
    return -1;
}
