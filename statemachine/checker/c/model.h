/* The compiled twin of spec/model: the same state, the same events, the same semantics,
 * interpreted through the same table rows (passed at run time). Each function names the
 * Python function it mirrors; the differential tests keep the two equal (same reachable
 * states, same edges, same verdicts). */
#ifndef KV_MODEL_H
#define KV_MODEL_H

#include <setjmp.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "tables.h"

#define MAXR 4          /* requests */
#define MAXG 3          /* KV cache groups (full attention, a sliding window or Mamba) */
#define MAXT 12         /* a block table's entries: a request's blocks in every group, flat,
                         * group by group (as many blocks per group) */
#define MAXJ 24         /* job records in a state (live and held) */
#define MAXB 16         /* GPU blocks */
#define MAXK 32         /* chunk keys: the prompts' (family * tokens + position), then each
                         * request's output, each in every group (kv_key) */
#define MAXID 32        /* job ids of one event stay below (masks are 32 bits) */

#define NONE8 0xFF      /* also a block table's null block (spec.groups.NULL_BLOCK) */
#define CH_ABSENT (-128)

typedef uint32_t KeyMask;  /* a set of chunk keys (bit k: key index k) */

/* each set bit of a 32-bit mask, lowest first: `v` is its position (a loop, so `continue`
 * and `return` work as in any loop) */
#define EACH_BIT(v, mask) \
    for (uint32_t v##_left = (mask), v = 0; v##_left && (v = (uint32_t)__builtin_ctz(v##_left), 1); \
         v##_left &= v##_left - 1)

enum { KIND_LOAD = 0, KIND_STORE = 1 };
enum { C_NONE = 0, C_WAITING, C_REMOTE, C_RUNNING, C_FINISHED };

/* job flags */
#define JF_SYNC 1
#define JF_FAILED 2
#define JF_FLUSH_REQ 4
#define JF_FLUSH_SHIPPED 8
#define JF_HELD 16      /* in w.held: the reset fence (STALE) or the timeout quarantine (TIMED_OUT) */
#define JF_QUAR 32      /* its GPU blocks are quarantined (quarantined_blocks entry) */
#define JF_TABLE 64     /* in w.jobs, the job table. A record is in the table, held, or (only
                         * under a broken table, a mutant) both, as Python's two dicts allow */
#define JF_BAD 128      /* the data's truth (truth.py): what it copies is invalid */

/* request flags */
#define RF_TRACKED 1
#define RF_FINISHED 2
#define RF_SIGNALED 4
#define RF_LOAD_INVALID 8
#define RF_SYNC_RES 16
#define RF_HIT 32
#define RF_KVLOAD 64
#define RF_SIGENTRY 128  /* the manager's signal count has an entry for it */

typedef struct {
    uint8_t id, kind, owner, state, pending, unreported, age, held_slots, flags, nblocks;
    uint16_t deferred, fenced;  /* its source blocks fenced once its owner finished, and at
                                 * once (a window group's: the core may free them) */
    KeyMask keys;
    uint8_t blocks[MAXT];
} Job;

typedef struct {
    uint8_t state, flags, hit, cursor, kv_load, nblocks, signals, after_signal;
    uint8_t load_failed;  /* FailedLoadLookup.FOR_LIFE: no later lookup asks the manager */
    KeyMask counted;      /* StoreAdmission.PER_REQUEST: the keys its offers counted in this
                           * cache generation */
    uint32_t jobs;
    uint8_t blocks[MAXT];
    /* the core's view (MCore), with the data's truth: its KV is invalid (ckv_bad), the load
     * that fills its blocks (cload, NONE8: none) */
    uint8_t cstatus, computed, loading, aborted, ncblocks, ckv_bad, cload;
    uint8_t crecv_failed; /* StaleLoadFailure.FENCE_ONLY: a worker named it in failed_recving */
    uint8_t generated;    /* output tokens sampled so far (MCore.generated); a restart keeps them */
    uint8_t window_end;   /* the tokens computed once its last scheduled step ran (MReq.window_end) */
    uint8_t cpromoted;    /* the core's waiting loop reached it after its async load ended and
                           * handed off the loaded state (MCore.promoted) */
    uint8_t cblocks[MAXT];
} Req;

typedef struct {
    Req req[MAXR];
    uint8_t njobs, counter, threshold, fence, reset_since_step;
    uint8_t pending_finished, pending_preempted;
    uint8_t budget[3];
    int8_t chunk[MAXK];
    uint8_t offers[MAXK];  /* store admission: each key's offers, counted up to the threshold */
    KeyMask being_loaded, bad_chunks;  /* bad_chunks: the data's truth */
    KeyMask unwritten;     /* the data's truth: chunks a load read a block of that no store
                            * wrote (ModelState.unwritten, INV-23) */
    uint8_t partial[MAXK]; /* the data's truth: the blocks (bit i: the chunk's i-th) a store
                            * wrote of a chunk it wrote in part; 0: whole (ModelState.partial) */
    KeyMask misplaced;     /* the data's truth: chunks a job copied from or to a block at
                            * another position than their own (ModelState.misplaced, INV-22) */
    uint16_t free_blocks;
    uint32_t to_flush;
    uint32_t block_fence[MAXB];
    Job job[MAXJ];  /* last: only the first njobs records are live, and only they are copied
                     * (kv_copy_state); the records beyond are not read */
} State;

/* a state's live part: everything before the job records, and the njobs records */
static inline size_t kv_live_bytes(const State *s) {
    return offsetof(State, job) + (size_t)s->njobs * sizeof(Job);
}

static inline void kv_copy_state(State *dst, const State *src) {
    memcpy(dst, src, kv_live_bytes(src));
}

typedef struct {
    int32_t requests, tokens, workers, cpu_chunks, gpu_blocks, resets, failures, preemptions;
    int32_t timeout_steps; /* -1: none */
    int32_t sync_loads, partial_reports, stray_reports;
    int32_t failed_load_for_life;  /* rules.failed_load_lookup is FOR_LIFE (vLLM 0.34) */
    int32_t store_threshold;       /* 1: every chunk offered is stored */
    int32_t per_request_admission; /* rules.store_admission is PER_REQUEST (vLLM 0.34) */
    int32_t stale_fence_only;      /* rules.stale_load_failure is FENCE_ONLY (vLLM 0.34) */
    int32_t decode_tokens;         /* output tokens each request generates after its prompt */
    int32_t offload_prompt_only;   /* stores stop at the prompt's end */
    int32_t blocks_per_chunk;      /* GPU blocks per CPU chunk */
    int32_t tokens_per_block;      /* tokens per GPU block (and per block hash) */
    int32_t groups;                /* KV cache groups */
    int32_t sliding;               /* bit g: group g is a sliding window */
    int32_t sliding_window;        /* a sliding window's tokens */
    int32_t last_token_before_caps;/* rules.last_token_cut is BEFORE_CAPS (vLLM 0.34) */
    int32_t retention;             /* a window's retention interval in tokens, -1: None */
    int32_t mamba;                 /* bit g: group g is a Mamba group in align mode, stored only
                                    * from the core's hand-offs (spec.groups.HANDOFF_KINDS) */
    int32_t partial_tails;         /* a hash per token: the prompt's last boundary inside a block
                                    * is stored and hit as a partial tail (Bounds.partial_tails) */
    int32_t partial_tail_from_prefix; /* rules.partial_tail_search is FROM_FULL_ATTENTION_PREFIX
                                       * (vLLM 0.34) */
    int32_t family[MAXR];
    /* each request's settings (spec.model.RequestSettings): -1 for no cap */
    int32_t max_load[MAXR], max_offload[MAXR], skip_reading[MAXR];
} Bounds;

/* the keyword arguments a trigger carries to its row's effects (spec.model's **kw) */
typedef struct {
    int hit_tokens, sync, count, live_jobs, job_id, end_chunk;
    KeyMask keys;
    int nblocks;
    uint8_t blocks[MAXT];
    uint16_t fenced;  /* fenced_block_ids */
} Kw;

typedef struct {
    const int32_t *rows;
    int nrows;
    /* rows of (machine, trigger, state), in table order */
    int16_t *index;   /* flattened lists, -1 terminated */
    int32_t *start[N_MACHINES];
    int ntrig[N_MACHINES], nstate[N_MACHINES];
} Tables;

enum { ERR_NONE = 0, ERR_NOT_ENABLED = 1, ERR_MODEL = 2, ERR_LIMIT = 3 };

typedef struct World World;
typedef int GuardFn(World *w, int subject, const Kw *kw);
typedef void EffectFn(World *w, int subject, const Kw *kw);

struct World {
    const Bounds *b;
    const Tables *t;
    uint32_t faults;
    /* the event's scratch */
    int step_open;
    uint32_t batch_jobs, batch_loads;
    uint16_t batch_alloc;
    uint8_t preempted_early;
    int short_hit;            /* the last lookup's hit ends a (vLLM) token short (World.short_hit) */
    uint8_t tails;            /* requests whose partial tail the core hands off in this step */
    uint8_t tail_copy[MAXR][MAXG];  /* ... each Mamba group's copy-on-write block */
    int has_new, last_job;
    Job pending_new;
    jmp_buf *jb;
    int err;
    char msg[200];
    uint64_t *fired;          /* coverage: the first stamp at which each row fired (may be
                               * NULL): a row that fires lowers its entry to `stamp` */
    uint64_t stamp;
    int check_inside;         /* check the invariants after a step's lookup and allocation */
    int inside_found, inside_inv, inside_hook;
    uint32_t without;         /* invariants switched off (bit i: INV-(i+1)) */
    State s;                  /* last: kv_apply zeroes the scratch before it, and copies in
                               * only the state's live part */
};

/* faults: FT_* of tables.h (spec.model.faults.Fault, in its order) */
#define FAULT(w, f) ((w)->faults & (1u << (f)))

/* events: kind | req << 3 | job << 6 | count << 11 | failed << 14 | admit << 15 |
 * promote << 16 (a step in which the core's waiting loop only promotes request req) */
enum { EV_ARRIVE, EV_ABORT, EV_STEP, EV_FINISH, EV_PREEMPT, EV_REPORT, EV_RESET, EV_STRAY };
#define EV(kind, req, job, count, failed, admit) \
    ((uint32_t)(kind) | ((uint32_t)(req) << 3) | ((uint32_t)(job) << 6) | \
     ((uint32_t)(count) << 11) | ((uint32_t)(failed) << 14) | ((uint32_t)(admit) << 15))
#define EV_KIND(e) ((e) & 7)
#define EV_REQ(e) (((e) >> 3) & 7)
#define EV_JOB(e) (((e) >> 6) & 31)
#define EV_COUNT(e) (((e) >> 11) & 7)
#define EV_FAILED(e) (((e) >> 14) & 1)
#define EV_ADMIT(e) (((e) >> 15) & 1)
#define EV_PROMOTE(e) (((e) >> 16) & 1)
#define EV_PROMOTING(req) (EV(EV_STEP, req, 0, 0, 0, 0) | (1u << 16))

/* model.c */
int kv_tables_init(Tables *t, const int32_t *rows, int nrows);
void kv_tables_free(Tables *t);
void kv_initial(const Bounds *b, State *s);
int kv_events(const Bounds *b, const State *s, uint32_t *out);
int kv_apply(const Bounds *b, const Tables *t, uint32_t faults, const State *s, uint32_t ev,
             State *out, uint64_t *fired, uint64_t stamp, int check_inside, uint32_t without,
             int *inside_inv, int *inside_hook, char *msg);
void kv_canonical(State *s);
int kv_key(const Bounds *b, int req, int pos, int group);
int kv_nkeys(const Bounds *b);
int kv_blocks_of(const Bounds *b, int tokens);
int kv_skipped_blocks(const Bounds *b, int group, int computed);
int kv_freed_position(const Bounds *b, int length, int i, int computed);

/* invariants.c: the first safety invariant (index 0 = INV-1) broken, or -1 */
int kv_check_invariants(const Bounds *b, const State *s, int step_open, uint32_t without);

#endif
