/* spec/model in C: interpreter, guards, effects, hooks, core, environment, canonical form.
 * Every function names its Python original; the semantics are the same, line for line. */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>

#include "model.h"
#include "dispatch.h"

/* ============================================================== errors (ModelError) */
static void fail(World *w, int err, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(w->msg, sizeof w->msg, fmt, ap);
    va_end(ap);
    w->err = err;
    longjmp(*w->jb, 1);
}

static int popcount16(uint32_t x) { return __builtin_popcount(x); }

/* ============================================================== subjects (state.py) */
/* a chunk's key index: a prompt position's is its family's (shared prefixes share keys), an
 * output position's the request's own (Template.block_key), after every prompt key; each
 * position has a key per group, next to each other (spec.groups.offload_key), so the indices
 * sort as the model's keys do */
int kv_key(const Bounds *b, int req, int pos, int group) {
    int at = pos < b->tokens ? b->family[req] * b->tokens + pos
                             : b->requests * b->tokens + req * b->decode_tokens + (pos - b->tokens);
    return at * b->groups + group;
}

int kv_nkeys(const Bounds *b) { return b->requests * (b->tokens + b->decode_tokens) * b->groups; }

/* decoding (World.num_tokens, sampled_last, tokens_to_compute, may_finish, sample) */
static int num_tokens(const World *w, int r) { return w->b->tokens + w->s.req[r].generated; }

static int sampled_last(const World *w, int r) {
    return w->b->decode_tokens > 0 && w->s.req[r].generated >= w->b->decode_tokens;
}

static int tokens_to_compute(const World *w, int r) { return num_tokens(w, r) - sampled_last(w, r); }

static int may_finish(const World *w, int r) {
    const Req *c = &w->s.req[r];
    int last = num_tokens(w, r) - 1;
    return c->cstatus == C_RUNNING && c->computed >= (w->b->tokens > last ? w->b->tokens : last);
}

static void sample(World *w, int r) {
    Req *c = &w->s.req[r];
    if (c->computed == num_tokens(w, r) && c->generated < w->b->decode_tokens) c->generated++;
}

/* tokens per chunk, and the blocks `tokens` tokens take (Bounds.tokens_per_chunk, blocks_of) */
static int tokens_per_chunk(const World *w) { return w->b->blocks_per_chunk * w->b->tokens_per_block; }

int kv_blocks_of(const Bounds *b, int tokens) {
    return (tokens + b->tokens_per_block - 1) / b->tokens_per_block;
}

/* window groups (spec.groups): whether group g is a sliding window, a Mamba group, either
 * (WINDOW_KINDS); the leading blocks of group g the core no longer holds once `computed`
 * tokens are computed (group_skipped_blocks), whether position i of a flat table of `length`
 * entries is one of them (freed_positions), a window group's window in chunks
 * (group_window_chunks) and the chunks its hit ending at `end` needs
 * (group_load_window_chunks): a Mamba group's state is one chunk */
static int windows(const Bounds *b) { return b->sliding | b->mamba; }
static int is_sliding(const World *w, int g) { return (w->b->sliding >> g) & 1; }
static int is_mamba(const World *w, int g) { return (w->b->mamba >> g) & 1; }
static int is_window(const World *w, int g) { return (windows(w->b) >> g) & 1; }

int kv_skipped_blocks(const Bounds *b, int group, int computed) {
    if ((b->mamba >> group) & 1)  /* every block before that of token computed - 1 */
        return (computed > 1 ? computed - 1 : 0) / b->tokens_per_block;
    if (!((b->sliding >> group) & 1)) return 0;
    int skipped = computed - b->sliding_window + 1;
    return (skipped > 0 ? skipped : 0) / b->tokens_per_block;
}

int kv_freed_position(const Bounds *b, int length, int i, int computed) {
    if (!windows(b) || length <= 0) return 0;
    int per = length / b->groups;
    return i % per < kv_skipped_blocks(b, i / per, computed);
}

static int cdiv(int a, int b) { return (a + b - 1) / b; }

static int window_chunks(const World *w, int g) {
    return is_mamba(w, g) ? 1 : cdiv(w->b->sliding_window, tokens_per_chunk(w));
}

static int load_window_chunks(const World *w, int g, int end) {
    if (is_mamba(w, g)) return 1;
    int tpc = tokens_per_chunk(w), pad = (tpc - end % tpc) % tpc;
    int more = cdiv(w->b->sliding_window - 1 + pad, tpc), window = window_chunks(w, g);
    return more > window ? more : window;
}

/* chunk `c`'s key in group `g`: the key at its last token (World.keys_of) */
static int chunk_key(const World *w, int r, int c, int g) {
    return kv_key(w->b, r, (c + 1) * tokens_per_chunk(w) - 1, g);
}

static Req *tracked(World *w, int r) {
    if (!(w->s.req[r].flags & RF_TRACKED)) fail(w, ERR_MODEL, "request r%d is not tracked", r);
    return &w->s.req[r];
}

static int job_pos(const State *s, int id) {
    for (int i = 0; i < s->njobs; i++)
        if (s->job[i].id == id) return i;
    return -1;
}

static Job *live_job(World *w, int id) {  /* w.jobs.get(id) */
    int i = job_pos(&w->s, id);
    return i >= 0 && (w->s.job[i].flags & JF_TABLE) ? &w->s.job[i] : NULL;
}

static Job *held_job(World *w, int id) {  /* w.held.get(id) */
    int i = job_pos(&w->s, id);
    return i >= 0 && (w->s.job[i].flags & JF_HELD) ? &w->s.job[i] : NULL;
}

static Job *job_of(World *w, int id) {    /* job_of: the table, the held jobs, the new one */
    if (id >= 0) {
        int i = job_pos(&w->s, id);
        if (i >= 0) return &w->s.job[i];
    }
    if (w->has_new && (id < 0 || w->pending_new.id == id)) return &w->pending_new;
    fail(w, ERR_MODEL, "job %d unknown", id);
    return NULL;
}

static void add_job(World *w, const Job *j) {  /* keep the records sorted by id */
    State *s = &w->s;
    if (s->njobs >= MAXJ) fail(w, ERR_LIMIT, "more than %d jobs", MAXJ);
    if (j->id >= MAXID) fail(w, ERR_LIMIT, "job id %d beyond %d", j->id, MAXID);
    int i = s->njobs;
    while (i > 0 && s->job[i - 1].id > j->id) {
        s->job[i] = s->job[i - 1];
        i--;
    }
    s->job[i] = *j;
    s->njobs++;
}

/* the core's allocation: the lowest free GPU block, taken from the pool (the caller has
 * counted that there is one) */
static uint8_t take_free_block(State *s) {
    int blk = __builtin_ctz(s->free_blocks);
    s->free_blocks &= (uint16_t)(s->free_blocks - 1);
    return (uint8_t)blk;
}

static void del_job(State *s, int id) {
    int i = job_pos(s, id);
    if (i < 0) return;
    for (; i + 1 < s->njobs; i++) s->job[i] = s->job[i + 1];
    s->njobs--;
}

/* ============================================================== the data's truth (truth.py) */
static void taint_owner(World *w, const Job *j) {
    Req *c = &w->s.req[j->owner];
    if (c->cstatus == C_NONE || c->cload != j->id) return;
    c->ckv_bad = 1;
    for (int i = 0; i < w->s.njobs; i++) {
        Job *o = &w->s.job[i];
        if ((o->flags & JF_TABLE) && o->owner == j->owner && o->kind == KIND_STORE) o->flags |= JF_BAD;
    }
}

static void failed_copy(World *w, int id) {
    int i = job_pos(&w->s, id);
    if (i < 0) return;
    Job *j = &w->s.job[i];
    j->flags |= JF_BAD;
    if (j->kind == KIND_LOAD) taint_owner(w, j);
}

static void truth_new_job(World *w, Job *j) {
    if (j->kind == KIND_STORE) {
        const Req *c = &w->s.req[j->owner];
        if (c->cstatus != C_NONE && c->ckv_bad) j->flags |= JF_BAD; else j->flags &= (uint8_t)~JF_BAD;
    } else if (j->keys & w->s.bad_chunks) {
        j->flags |= JF_BAD;
    } else {
        j->flags &= (uint8_t)~JF_BAD;
    }
}

static void published(World *w, const Job *j, KeyMask ready) {
    if (j->flags & JF_BAD) w->s.bad_chunks |= ready; else w->s.bad_chunks &= ~ready;
}

/* ============================================================== the interpreter */
int kv_tables_init(Tables *t, const int32_t *rows, int nrows) {
    static const int ntrig[N_MACHINES] = {N_R_TRIGGERS, N_J_TRIGGERS, N_F_TRIGGERS};
    static const int nstate[N_MACHINES] = {N_R_STATES, N_J_STATES, N_F_STATES};
    memset(t, 0, sizeof *t);
    t->rows = rows;
    t->nrows = nrows;
    int cells = 0;
    for (int m = 0; m < N_MACHINES; m++) {
        t->ntrig[m] = ntrig[m];
        t->nstate[m] = nstate[m];
        cells += ntrig[m] * nstate[m];
    }
    /* each (machine, trigger, state) cell: offset of its -1 terminated row list */
    int total = 0;
    for (int m = 0; m < N_MACHINES; m++) {
        t->start[m] = calloc((size_t)(ntrig[m] * nstate[m]), sizeof(int32_t));
        if (!t->start[m]) return -1;
    }
    int size = cells + nrows * 32 + 1;
    t->index = malloc(sizeof(int16_t) * (size_t)size);
    if (!t->index) return -1;
    for (int m = 0; m < N_MACHINES; m++)
        for (int tr = 0; tr < ntrig[m]; tr++)
            for (int st = 0; st < nstate[m]; st++) {
                t->start[m][tr * nstate[m] + st] = total;
                for (int r = 0; r < nrows; r++) {
                    const int32_t *row = rows + r * ROW_WIDTH;
                    if (row[0] == m && row[1] == tr && (row[2] >> st) & 1) t->index[total++] = (int16_t)r;
                }
                t->index[total++] = -1;
                if (total >= size) return -1;
            }
    return 0;
}

void kv_tables_free(Tables *t) {
    for (int m = 0; m < N_MACHINES; m++) free(t->start[m]);
    free(t->index);
}

static GuardFn *const *const GUARD_TABLES[N_MACHINES] = {R_GUARDS, J_GUARDS, F_GUARDS};

static int guards_hold(World *w, int m, uint32_t requires, uint32_t unless, int subject,
                       const Kw *kw) {
    for (int g = 0; requires >> g; g++)
        if ((requires >> g) & 1 && !GUARD_TABLES[m][g](w, subject, kw)) return 0;
    for (int g = 0; unless >> g; g++)
        if ((unless >> g) & 1 && GUARD_TABLES[m][g](w, subject, kw)) return 0;
    return 1;
}

static const char *const MACHINE_NAMES[N_MACHINES] = {"request", "job", "fence"};

/* fire: move subject `subject` of machine `m` by `trigger`, through the table */
static int fire(World *w, int m, int subject, int trigger, const Kw *kw) {
    static const Kw none = {.count = 1};
    if (!kw) kw = &none;
    int state;
    Job *job = NULL;
    if (m == M_REQUEST) state = w->s.req[subject].state;
    else if (m == M_JOB) { job = job_of(w, subject); state = job->state; }
    else state = w->s.fence;
    const Tables *t = w->t;
    for (const int16_t *r = t->index + t->start[m][trigger * t->nstate[m] + state]; *r >= 0; r++) {
        const int32_t *row = t->rows + *r * ROW_WIDTH;
        if (!guards_hold(w, m, (uint32_t)row[4], (uint32_t)row[5], subject, kw)) continue;
        int dest = row[3] < 0 ? state : row[3];
        if (w->fired && w->fired[*r] > w->stamp) w->fired[*r] = w->stamp;
        if (m == M_REQUEST) {  /* World.put: a request stays tracked until deleted */
            Req *q = &w->s.req[subject];
            if (dest != R_ABSENT || (q->flags & RF_TRACKED)) {
                q->state = (uint8_t)dest;
                q->flags |= RF_TRACKED;
            }
        } else if (m == M_JOB) {
            job->state = (uint8_t)dest;
        } else {
            w->s.fence = (uint8_t)dest;
        }
        for (int e = 0; e < row[6]; e++) EFFECTS[row[7 + e]](w, subject, kw);
        return dest;
    }
    fail(w, ERR_MODEL, "%s %d in state %d: no transition for trigger %d", MACHINE_NAMES[m],
         subject, state, trigger);
    return -1;
}

/* ============================================================== guards */
static int guard_R_other_jobs_remain(World *w, int r, const Kw *kw) { (void)kw; return w->s.req[r].jobs != 0; }
static int guard_R_has_transfer_jobs(World *w, int r, const Kw *kw) { (void)kw; return w->s.req[r].jobs != 0; }
static int guard_R_load_invalid(World *w, int r, const Kw *kw) { (void)kw; return (w->s.req[r].flags & RF_LOAD_INVALID) != 0; }
static int guard_J_owner_has_no_jobs(World *w, int j, const Kw *kw) { (void)kw; return w->s.req[job_of(w, j)->owner].jobs == 0; }
static int guard_J_reports_complete(World *w, int j, const Kw *kw) { return kw->count >= job_of(w, j)->pending; }
static int guard_F_has_live_jobs(World *w, int f, const Kw *kw) { (void)w; (void)f; return kw->live_jobs > 0; }
static int guard_F_fence_empties(World *w, int f, const Kw *kw) {
    (void)f; (void)kw;
    for (int i = 0; i < w->s.njobs; i++)
        if ((w->s.job[i].flags & JF_HELD) && w->s.job[i].state == J_STALE) return 0;
    return 1;
}

/* ============================================================== request effects */
static void copy_blocks(uint8_t *dst, const uint8_t *src, int count) {
    memset(dst, 0, MAXT);
    memcpy(dst, src, (size_t)count);
}

static void set_blocks(uint8_t *dst, uint8_t *n, const uint8_t *src, int count) {
    copy_blocks(dst, src, count);
    *n = (uint8_t)count;
}

static void eff_create_request_status(World *w, int r, const Kw *kw) {
    (void)kw;
    Req *q = &w->s.req[r];
    if (!(q->flags & RF_SIGENTRY)) { q->flags |= RF_SIGENTRY; q->signals = 0; }
}

static void eff_restart_from_token_zero(World *w, int r, const Kw *kw) {
    (void)kw;
    Req *q = tracked(w, r);
    memset(q->blocks, 0, MAXT);
    q->nblocks = 0;
    q->cursor = 0;
    q->hit = 0;
    q->kv_load = 0;
    q->window_end = 0;
    q->flags &= (uint8_t)~(RF_HIT | RF_KVLOAD);
}

static void eff_start_deferral_timer(World *w, int r, const Kw *kw) { (void)w; (void)r; (void)kw; }

static void eff_record_lookup_hit(World *w, int r, const Kw *kw) {
    Req *q = tracked(w, r);
    if (kw->hit_tokens > 0) { q->flags |= RF_HIT; q->hit = (uint8_t)kw->hit_tokens; }
    else { q->flags &= (uint8_t)~RF_HIT; q->hit = 0; }
    if (kw->sync) q->flags |= RF_SYNC_RES; else q->flags &= (uint8_t)~RF_SYNC_RES;
}

static void eff_bypass_offload_lookup(World *w, int r, const Kw *kw) {
    (void)kw;
    tracked(w, r)->flags &= (uint8_t)~RF_LOAD_INVALID;
}

static void new_job(World *w, int kind, int owner, const Kw *kw) {
    Job j;
    memset(&j, 0, sizeof j);
    j.id = NONE8;
    j.kind = (uint8_t)kind;
    j.owner = (uint8_t)owner;
    j.state = J_UNALLOCATED;
    j.pending = j.unreported = (uint8_t)w->b->workers;
    j.age = NONE8;
    j.keys = kw->keys;
    set_blocks(j.blocks, &j.nblocks, kw->blocks, kw->nblocks);
    if (kind == KIND_LOAD && kw->sync) j.flags |= JF_SYNC;
    if (kind == KIND_STORE) {  /* a window source is fenced at once, the others once it finished */
        for (int i = 0; i < kw->nblocks; i++) j.deferred |= (uint16_t)(1u << kw->blocks[i]);
        j.fenced = kw->fenced;
        j.deferred &= (uint16_t)~kw->fenced;
    }
    w->pending_new = j;
    w->has_new = 1;
}

static void eff_create_load_job(World *w, int r, const Kw *kw) {
    new_job(w, KIND_LOAD, r, kw);
    fire(w, M_JOB, -1, JT_create_load, NULL);
    Req *q = tracked(w, r);
    q->flags &= (uint8_t)~(RF_HIT | RF_KVLOAD);
    q->hit = 0;
    q->cursor = (uint8_t)kw->end_chunk;
    q->kv_load = 0;
    if (kw->sync) { q->flags |= RF_KVLOAD; q->kv_load = (uint8_t)w->last_job; }
}

static void eff_mark_chunks_being_loaded(World *w, int r, const Kw *kw) {
    (void)r;
    w->s.being_loaded |= kw->keys;
}

static void eff_record_block_ids(World *w, int r, const Kw *kw) {
    Req *q = tracked(w, r);
    set_blocks(q->blocks, &q->nblocks, kw->blocks, kw->nblocks);
}

static void eff_create_store_job(World *w, int r, const Kw *kw) {
    new_job(w, KIND_STORE, r, kw);
    fire(w, M_JOB, -1, JT_create_store, NULL);
    tracked(w, r)->cursor = (uint8_t)kw->end_chunk;
}

static void eff_count_allocation_failure(World *w, int r, const Kw *kw) { (void)w; (void)r; (void)kw; }

static void eff_flush_request_jobs(World *w, int r, const Kw *kw) {
    (void)kw;
    if (FAULT(w, FT_PREEMPT_SKIPS_FLUSH)) return;
    uint32_t ids = tracked(w, r)->jobs & ~w->batch_loads;
    for (int id = 0; id < MAXID; id++)
        if ((ids >> id) & 1 && live_job(w, id)) fire(w, M_JOB, id, JT_flush, NULL);
}

static void fence_add(World *w, int block, int id) { w->s.block_fence[block] |= 1u << id; }

static void eff_register_deferred_fences(World *w, int r, const Kw *kw) {
    (void)kw;
    if (FAULT(w, FT_FINISH_SKIPS_DEFERRED_FENCE)) return;
    uint32_t ids = tracked(w, r)->jobs;
    for (int id = 0; id < MAXID; id++) {
        Job *j = (ids >> id) & 1 ? live_job(w, id) : NULL;
        if (!j) continue;
        for (int b = 0; b < MAXB; b++)
            if ((j->deferred >> b) & 1) fence_add(w, b, id);
    }
}

static void eff_signal_request_finished(World *w, int r, const Kw *kw) {
    (void)kw;
    Req *q = tracked(w, r);
    if (!(q->flags & RF_SIGNALED) || FAULT(w, FT_RESET_SIGNALS_TWICE)) {
        q->flags |= RF_SIGNALED;
        if (!(q->flags & RF_SIGENTRY)) { q->flags |= RF_SIGENTRY; q->signals = 0; }
        q->signals++;
    }
}

static void eff_delete_request_status(World *w, int r, const Kw *kw) {
    (void)kw;
    Req *q = &w->s.req[r];
    uint8_t keep = q->flags & RF_SIGENTRY;
    q->state = R_ABSENT;
    q->flags = keep;
    q->hit = q->cursor = q->kv_load = q->nblocks = q->load_failed = q->window_end = 0;
    q->counted = 0;
    q->jobs = 0;
    memset(q->blocks, 0, MAXT);
}

static void eff_reset_store_cursor(World *w, int r, const Kw *kw) {
    (void)kw;
    Req *q = tracked(w, r);
    q->cursor = 0;
    q->hit = 0;
    q->flags &= (uint8_t)~RF_HIT;
    /* _window_blocks_forgotten: the window positions before the window of its computed
     * tokens, which the core freed (beyond vLLM 0.33.0, which keeps them) */
    if (!FAULT(w, FT_RESET_KEEPS_STALE_WINDOW_BLOCKS))
        for (int i = 0; i < q->nblocks; i++)
            if (kv_freed_position(w->b, q->nblocks, i, q->window_end)) q->blocks[i] = NONE8;
}

static void eff_drop_request_jobs(World *w, int r, const Kw *kw) {
    (void)kw;
    uint32_t held = tracked(w, r)->jobs;
    for (int id = 0; id < MAXID; id++)
        if ((held >> id) & 1 && live_job(w, id)) fire(w, M_JOB, id, JT_reset, NULL);
    if (w->s.req[r].flags & RF_TRACKED) w->s.req[r].jobs = 0;
}

static void eff_mark_load_invalid(World *w, int r, const Kw *kw) {
    (void)kw;
    Req *q = tracked(w, r);
    q->flags |= RF_LOAD_INVALID;
    if (w->b->failed_load_for_life) q->load_failed = 1;
}

static void eff_poison_request_stores(World *w, int r, const Kw *kw) {
    (void)kw;
    uint32_t ids = tracked(w, r)->jobs;
    for (int id = 0; id < MAXID; id++) {
        Job *j = (ids >> id) & 1 ? live_job(w, id) : NULL;
        if (j && j->kind == KIND_STORE && j->state != J_FAILING) fire(w, M_JOB, id, JT_poison, NULL);
    }
}

static void eff_quarantine_load_blocks(World *w, int r, const Kw *kw) {
    (void)r;
    Job *j = held_job(w, kw->job_id);
    if (!j) fail(w, ERR_MODEL, "quarantine of job %d, which is not held", kw->job_id);
    j->flags |= JF_QUAR;
}

static void eff_signal_untracked_finished(World *w, int r, const Kw *kw) {
    (void)kw;
    Req *q = &w->s.req[r];
    if (!(q->flags & RF_SIGENTRY)) { q->flags |= RF_SIGENTRY; q->signals = 0; }
    q->signals++;
}

static void eff_promote_after_recving(World *w, int r, const Kw *kw) { (void)w; (void)r; (void)kw; }

/* ============================================================== job effects */
static void eff_allocate_job_id(World *w, int k, const Kw *kw) {
    (void)kw;
    Job *j = job_of(w, k);
    j->id = w->s.counter++;
    if (j->id >= MAXID) fail(w, ERR_LIMIT, "job id %d beyond %d", j->id, MAXID);
}

static void eff_pin_load_chunks(World *w, int k, const Kw *kw) {
    (void)k; (void)kw;
    KeyMask keys = w->pending_new.keys;
    for (int c = 0; c < MAXK; c++) {
        if (!((keys >> c) & 1)) continue;
        if (w->s.chunk[c] < 0) fail(w, ERR_MODEL, "prepare_load of chunk %d that is not ready", c);
        w->s.chunk[c]++;
    }
}

static void eff_protect_store_chunks(World *w, int k, const Kw *kw) { (void)w; (void)k; (void)kw; }

static void eff_enter_job_table(World *w, int k, const Kw *kw) {
    (void)k; (void)kw;
    Job j = w->pending_new;
    w->has_new = 0;
    j.flags |= JF_TABLE;
    truth_new_job(w, &j);
    add_job(w, &j);
    Req *q = tracked(w, j.owner);
    q->jobs |= 1u << j.id;
    w->batch_jobs |= 1u << j.id;
    if (j.kind == KIND_LOAD) w->batch_loads |= 1u << j.id;
    w->last_job = j.id;
}

static void eff_register_store_fences(World *w, int k, const Kw *kw) {
    (void)k; (void)kw;
    int id = w->last_job;
    Job *j = live_job(w, id);
    if (!j) fail(w, ERR_MODEL, "store %d not in the table", id);
    if (!FAULT(w, FT_SLIDING_WINDOW_SKIPS_FENCE))  /* a window source: the core may free it any step */
        for (int b = 0; b < MAXB; b++)
            if ((j->fenced >> b) & 1) fence_add(w, b, id);
    if (tracked(w, j->owner)->flags & RF_FINISHED) {
        for (int b = 0; b < MAXB; b++)
            if ((j->deferred >> b) & 1) fence_add(w, b, id);
        if (j->deferred & w->batch_alloc) fire(w, M_JOB, id, JT_flush, NULL);
    }
}

static void eff_put_in_metadata(World *w, int k, const Kw *kw) { (void)kw; job_of(w, k)->age = 0; }

static void eff_add_to_jobs_to_flush(World *w, int k, const Kw *kw) {
    (void)kw;
    Job *j = job_of(w, k);
    if (FAULT(w, FT_RESET_SKIPS_FLUSH) && j->state == J_STALE) return;
    j->flags |= JF_FLUSH_REQ;
    w->s.to_flush |= 1u << k;
}

static void eff_count_report(World *w, int k, const Kw *kw) {
    Job *j = job_of(w, k);
    if (FAULT(w, FT_STORE_READY_ON_FIRST_ACK) && j->kind == KIND_STORE && j->state != J_STALE) {
        KeyMask ready = 0;
        for (int c = 0; c < MAXK; c++)
            if ((j->keys >> c) & 1 && w->s.chunk[c] == -1) { w->s.chunk[c] = 0; ready |= (KeyMask)1 << c; }
        published(w, j, ready);
    }
    j->pending = (uint8_t)(j->pending - kw->count);
}

static void eff_mark_failed(World *w, int k, const Kw *kw) { (void)kw; job_of(w, k)->flags |= JF_FAILED; }

static void unpin(World *w, KeyMask keys) {
    for (int c = 0; c < MAXK; c++)
        if ((keys >> c) & 1 && w->s.chunk[c] != CH_ABSENT && w->s.chunk[c] > 0) w->s.chunk[c]--;
}

static void unmark(World *w, const Job *j) {  /* only an async load marked its keys */
    if (!(j->flags & JF_SYNC)) w->s.being_loaded &= ~j->keys;
}

static void eff_complete_in_manager(World *w, int k, const Kw *kw) {
    (void)kw;
    Job *j = job_of(w, k);
    if (j->kind == KIND_STORE) {
        KeyMask ready = 0;
        for (int c = 0; c < MAXK; c++)
            if ((j->keys >> c) & 1 && w->s.chunk[c] == -1) { w->s.chunk[c] = 0; ready |= (KeyMask)1 << c; }
        published(w, j, ready);
    } else {
        if (j->flags & JF_BAD) taint_owner(w, j);
        if (!FAULT(w, FT_COMPLETE_LOAD_KEEPS_PIN)) unpin(w, j->keys);
        if (!FAULT(w, FT_LOAD_KEEPS_CHUNKS_BEING_LOADED)) unmark(w, j);
    }
}

static void eff_roll_back_in_manager(World *w, int k, const Kw *kw) {
    (void)kw;
    Job *j = job_of(w, k);
    if (j->kind == KIND_STORE) {
        for (int c = 0; c < MAXK; c++)
            if ((j->keys >> c) & 1 && w->s.chunk[c] == -1) w->s.chunk[c] = CH_ABSENT;
    } else {
        unpin(w, j->keys);
        unmark(w, j);
    }
}

static void eff_leave_job_table(World *w, int k, const Kw *kw) {
    (void)kw;
    Job *lj = live_job(w, k);
    if (!lj) return;
    Job j = *lj;
    Req *q = &w->s.req[j.owner];
    int kept = j.state == J_STALE && FAULT(w, FT_RESET_KEEPS_TRANSFER_JOBS);
    if ((q->flags & RF_TRACKED) && !kept) q->jobs &= ~(1u << k);
    for (int b = 0; b < MAXB; b++)
        if (((j.deferred | j.fenced) >> b) & 1) w->s.block_fence[b] &= ~(1u << k);
    lj->flags &= (uint8_t)~JF_TABLE;  /* w.jobs.pop(k) */
    if (j.state == J_STALE || j.state == J_TIMED_OUT) {
        lj->flags |= JF_HELD;
        if (j.state == J_STALE) return;
    } else if (!(lj->flags & JF_HELD)) {
        del_job(&w->s, k);
    }
    int trig = (j.kind == KIND_STORE ? ENDING_STORE : ENDING_LOAD)[j.state];
    if (trig < 0) fail(w, ERR_MODEL, "job %d left the table in state %d", k, j.state);
    Kw out;
    memset(&out, 0, sizeof out);
    out.count = 1;
    out.job_id = k;
    copy_blocks(out.blocks, j.blocks, j.nblocks);
    out.nblocks = j.nblocks;
    fire(w, M_REQUEST, j.owner, trig, &out);
}

static void eff_enter_timeout_quarantine(World *w, int k, const Kw *kw) {
    (void)kw;
    Job *j = job_of(w, k);
    if (j->kind == KIND_STORE) {
        int held = 0;
        for (int c = 0; c < MAXK; c++)
            if ((j->keys >> c) & 1 && w->s.chunk[c] == -1) { w->s.chunk[c] = CH_ABSENT; held++; }
        j->held_slots = (uint8_t)held;
    } else {
        unmark(w, j);
    }
}

/* w.held.pop(k): the record goes, unless (a broken table) it is in the job table too */
static void forget_held(World *w, Job *j) {
    j->flags &= (uint8_t)~(JF_HELD | JF_QUAR);
    if (!(j->flags & JF_TABLE)) del_job(&w->s, j->id);
}

/* core.unquarantine: a quarantined load's destination blocks go back to the pool, except
 * those the core still holds */
static void unquarantine(World *w, const Job *j) {
    if (!(j->flags & JF_QUAR)) return;
    uint16_t held = 0;
    for (int r = 0; r < MAXR; r++) {
        const Req *q = &w->s.req[r];
        if (q->cstatus == C_NONE) continue;
        for (int k = 0; k < q->ncblocks; k++)
            if (q->cblocks[k] != NONE8) held |= (uint16_t)(1u << q->cblocks[k]);
    }
    for (int k = 0; k < j->nblocks; k++)
        if (!((held >> j->blocks[k]) & 1)) w->s.free_blocks |= (uint16_t)(1u << j->blocks[k]);
}

static void eff_release_quarantine(World *w, int k, const Kw *kw) {
    (void)kw;
    Job *j = held_job(w, k);
    if (!j) fail(w, ERR_MODEL, "release of job %d, which is not held", k);
    if (j->kind == KIND_LOAD) unpin(w, j->keys);
    unquarantine(w, j);
    forget_held(w, j);
}

static void eff_enter_reset_fence(World *w, int k, const Kw *kw) {
    (void)kw;
    Job *j = job_of(w, k);
    j->flags |= JF_HELD;
    j->held_slots = 0;
}

static void eff_count_stale_report(World *w, int k, const Kw *kw) {
    Job *j = held_job(w, k);
    if (!j) fail(w, ERR_MODEL, "stale report of job %d, which is not held", k);
    j->pending = (uint8_t)(j->pending - kw->count);
}

static void eff_invalidate_orphaned_load(World *w, int k, const Kw *kw) {
    (void)kw;
    if (w->b->stale_fence_only) return;  /* the core hears of it (crecv_failed) */
    if (FAULT(w, FT_STALE_LOAD_FAILURE_IGNORED)) return;
    Job *j = held_job(w, k);
    if (!j) fail(w, ERR_MODEL, "job %d is not held", k);
    Req *q = &w->s.req[j->owner];
    if (j->kind == KIND_LOAD && (q->flags & RF_TRACKED) && q->state == R_ORPHANED_LOAD)
        q->flags |= RF_LOAD_INVALID;
}

static void eff_invalidate_owner_kv(World *w, int k, const Kw *kw) {
    (void)kw;
    Job *j = job_of(w, k);
    Req *q = &w->s.req[j->owner];
    if (j->kind == KIND_LOAD && (j->flags & JF_SYNC) && (q->flags & RF_TRACKED) &&
        (q->flags & RF_KVLOAD) && q->kv_load == k)
        fire(w, M_REQUEST, j->owner, RT_kv_invalidated, NULL);
}

static void eff_leave_reset_fence(World *w, int k, const Kw *kw) {
    (void)kw;
    Job *j = held_job(w, k);
    if (j) {
        unquarantine(w, j);
        forget_held(w, j);
    }
}

/* ============================================================== fence effects */
static void eff_extend_fence(World *w, int f, const Kw *kw) { (void)w; (void)f; (void)kw; }
static void eff_signal_reset_flushed(World *w, int f, const Kw *kw) { (void)w; (void)f; (void)kw; }
static void eff_count_ignored_report(World *w, int f, const Kw *kw) { (void)w; (void)f; (void)kw; }

/* ============================================================== inside checks */
static void inside(World *w, int hook) {
    if (!w->check_inside || w->inside_found) return;
    int inv = kv_check_invariants(w->b, &w->s, 1, w->without);
    if (inv >= 0) { w->inside_found = 1; w->inside_inv = inv; w->inside_hook = hook; }
}

/* ============================================================== hooks (hooks.py) */
#define IN(group, state) (((group) >> (state)) & 1)

/* _tail_hit: the partial-tail refinement of a complete hit of `complete` tokens (S:1068-1152):
 * from the furthest hash boundary the hit may reach inside the next block down to the
 * complete hit's end, the first boundary whose keys every group holds ready extends the hit
 * to it; a write-pending key met before a miss defers the lookup (*defer) if the complete hit
 * is empty. The next block is the one after the complete hit, or, under 0.34.0's search
 * (partial_tail_from_prefix), the one after the full-attention groups' hit `fa`, unless a
 * chunk of theirs between the two is being loaded. */
static int tail_hit(World *w, int r, int complete, int fa, int *defer) {
    const Bounds *b = w->b;
    int tpb = b->tokens_per_block, edge = complete, anchor = complete, pending = 0;
    int prefix = b->partial_tail_from_prefix;
    if (prefix && fa > edge) {
        for (int g = 0; g < b->groups; g++)
            if (!is_window(w, g))
                for (int c = edge / tpb; c < fa / tpb; c++)
                    pending |= (w->s.being_loaded >> chunk_key(w, r, c, g)) & 1;
        if (!pending) anchor = fa;
    }
    int furthest = b->tokens - 1 < anchor + tpb - 1 ? b->tokens - 1 : anchor + tpb - 1;
    if (b->max_load[r] >= 0 && b->max_load[r] < furthest) furthest = b->max_load[r];
    if (furthest <= edge) return complete;  /* no boundary to search (S@0.34.0:1210-1211) */
    for (int boundary = furthest; boundary > edge; boundary--) {
        if (boundary <= anchor && boundary % tpb == 0) continue;  /* a complete chunk */
        int missing = b->groups, here = 0;
        for (int g = 0; g < b->groups; g++)
            if (w->s.chunk[kv_key(b, r, boundary - 1, g)] == CH_ABSENT) { missing = g; break; }
        for (int g = 0; g < missing; g++) here |= w->s.chunk[kv_key(b, r, boundary - 1, g)] == -1;
        if (prefix)  /* a key another load still brings (S@0.34.0:1303-1309) */
            for (int g = 0; g <= missing && g < b->groups; g++)
                here |= (w->s.being_loaded >> kv_key(b, r, boundary - 1, g)) & 1;
        if (missing == b->groups && !here) return boundary;
        pending |= here;
    }
    if (pending && complete == 0) *defer = 1;
    return complete;
}

/* lookup: get_num_new_matched_tokens; returns the hit (-1: None) and whether async */
static int lookup(World *w, int r, int *is_async) {
    Req *q = tracked(w, r);
    *is_async = 0;
    if (IN(RS_SCHEDULED, q->state)) {
        fire(w, M_REQUEST, r, RT_preempt, NULL);
        w->preempted_early |= (uint8_t)(1u << r);
        q = tracked(w, r);
    }
    w->step_open = 1;
    if (q->state == R_PREEMPTED_FLUSHING && !FAULT(w, FT_LOOKUP_IGNORES_TRANSFER_JOBS)) {
        fire(w, M_REQUEST, r, RT_lookup_blocked, NULL);
        return -1;
    }
    if (IN(RS_MUST_RECOMPUTE, q->state)) {
        fire(w, M_REQUEST, r, RT_lookup_resolved, NULL);
        return 0;
    }
    /* _hit: whole chunks from the start, up to the whole hash blocks before the last token;
     * the hit may end inside its last chunk (a chunk's last token the request has not
     * reached). The full-attention groups scan a prefix, then the window groups the last
     * run of a window's worth of hits (_scan); a group that hits less shortens the hit,
     * which sends the groups round again until it converges: all of them after a deferral,
     * the window groups after a window group's answer. Beside a window group vLLM 0.33.0
     * stops the hit a token before the bound: the hit keeps the block but is short until a
     * group's answer cuts it to a chunk edge (LastTokenCut.AFTER_CAPS). 0.34.0 takes that
     * token off before the caps, which the bound already leaves out: no hit is short
     * (LastTokenCut.BEFORE_CAPS). Beside a Mamba group the hit is cut to whole chunks at
     * once (its state exists only at chunk edges); with partial tails the bound counts a
     * hash per token, and a tail inside the next block may extend the hit (tail_hit). */
    int tpc = tokens_per_chunk(w), tpb = w->b->tokens_per_block, all = num_tokens(w, r);
    int unit = w->b->partial_tails ? 1 : tpb;  /* Bounds.tokens_per_hash */
    int nkeys = all / tpc, max_hit = (all - 1) / unit * unit, cap = w->b->max_load[r];
    int fa_hit = -1;  /* the full-attention groups' hit as the first window group saw it
                       * (World.full_attention_hit; -1: None) */
    int shorter = windows(w->b) != 0 && !w->b->last_token_before_caps, num_hit = 0, defer = 0, end = 0;
    int order[MAXG], norder = 0;
    for (int g = 0; g < w->b->groups; g++) if (!is_window(w, g)) order[norder++] = g;
    for (int g = 0; g < w->b->groups; g++) if (is_window(w, g)) order[norder++] = g;
    enum { NONE = 0, EVERY_GROUP, WINDOW_GROUPS } todo = EVERY_GROUP;
    if (w->b->skip_reading[r]) max_hit = 0;  /* S:1258-1259 */
    if (q->load_failed) max_hit = 0;  /* a faulting load is not retried (S@0.34.0:1411) */
    if (cap >= 0 && cap < max_hit) max_hit = cap;  /* S:867-871 */
    if (w->b->mamba) {  /* a Mamba state exists only at chunk edges: whole chunks at once (S:877-881) */
        max_hit = max_hit - shorter >= 0 ? (max_hit - shorter) / tpc * tpc : -tpc;
        shorter = 0;
    }
    while (todo != NONE) {
        int pass = todo, looked_window = 0;
        todo = NONE;
        for (int i = 0; i < norder; i++) {
            int g = order[i], window = is_window(w, g);
            if (pass == WINDOW_GROUPS && !window) continue;
            if (nkeys * tpc < max_hit) { max_hit = nkeys * tpc; shorter = 0; }
            if (cap >= 0) { max_hit = (max_hit - shorter) / tpc * tpc; shorter = 0; }  /* whole chunks under a cap (S:917-920) */
            if (max_hit < tpc + shorter) goto empty;
            if (window && fa_hit < 0)  /* S@0.34.0:992-1001 */
                fa_hit = norder > popcount16((uint32_t)windows(w->b)) && !defer ? max_hit : 0;
            int n_chunks = cdiv(max_hit, tpc), found = 0, pending = 0;
            if (n_chunks > nkeys) n_chunks = nkeys;
            if (!window) {  /* the prefix scan */
                for (int c = 0; c < n_chunks; c++) {
                    int8_t ref = w->s.chunk[chunk_key(w, r, c, g)];
                    if (ref == CH_ABSENT) break;
                    pending |= ref == -1;
                    found++;
                }
            } else {  /* the suffix-window scan: the first run, at the right edge, may need a
                       * chunk more (a partial rightmost chunk), later ones a window */
                int need = load_window_chunks(w, g, max_hit < n_chunks * tpc ? max_hit : n_chunks * tpc);
                int run = 0, done = 0;
                for (int c = n_chunks - 1; c >= 0 && !done; c--) {
                    int8_t ref = w->s.chunk[chunk_key(w, r, c, g)];
                    if (ref == CH_ABSENT) { run = 0; pending = 0; need = window_chunks(w, g); continue; }
                    pending |= ref == -1;
                    if (++run == need) { found = c + need; done = 1; }
                }
                if (!done) found = run;
            }
            if (!pending && found == 0) goto empty;
            if (pending) defer = 1;
            else if (tpc * found < max_hit) { max_hit = tpc * found; shorter = 0; }
            if (max_hit < tpc + shorter) goto empty;
            if (max_hit < num_hit) {
                if (defer) { defer = 0; todo = EVERY_GROUP; }
                else if (looked_window && todo == NONE) todo = WINDOW_GROUPS;
            }
            looked_window |= window;
            num_hit = max_hit;
        }
    }
    end = num_hit;
    w->short_hit = shorter && num_hit > 0;
    for (int g = 0; g < w->b->groups && !defer; g++) {  /* a hit chunk an async load still brings (S:1021-1045) */
        int to = cdiv(end, tpc), from = 0;
        if (is_window(w, g) && to - load_window_chunks(w, g, end) > 0) from = to - load_window_chunks(w, g, end);
        for (int c = from; c < to; c++)
            if ((w->s.being_loaded >> chunk_key(w, r, c, g)) & 1) defer = 1;
    }
    if (0) {
empty:  /* no hit, at once */
        defer = 0;
        w->short_hit = 0;
        end = 0;
    }
    if (!defer && w->b->partial_tails && !q->load_failed && !w->b->skip_reading[r])
        end = tail_hit(w, r, end, fa_hit < 0 ? 0 : fa_hit, &defer);
    if (defer) {
        fire(w, M_REQUEST, r, RT_lookup_deferred, NULL);
        return -1;
    }
    int hit = end;
    int sync = w->b->sync_loads && hit > 0;
    Kw kw;
    memset(&kw, 0, sizeof kw);
    kw.count = 1;
    kw.hit_tokens = hit;
    kw.sync = sync;
    fire(w, M_REQUEST, r, RT_lookup_resolved, &kw);
    *is_async = hit > 0 && !sync;
    return hit;
}

/* alloc: update_state_after_alloc: per group, the load fills the blocks from the first one
 * allocated (a window group's window) to the hit's end, from the chunks that cover them; a
 * partial-tail hit (ending inside a chunk, with partial tails) reads its last block from the
 * boundary's key (S:1374-1377, S:1428-1442). The data's truth: a read of a block no store
 * wrote (INV-23), a chunk copied to another position than its own (INV-22). Neither is
 * changed by the load's row, so both may come before it fires. */
static void alloc(World *w, int r, const uint8_t *blocks, int n, int hit) {
    for (int i = 0; i < n; i++)
        if (blocks[i] != NONE8) w->batch_alloc |= (uint16_t)(1u << blocks[i]);
    if (hit == 0) {
        Req *q = tracked(w, r);
        q->flags &= (uint8_t)~RF_HIT;
        q->hit = 0;
        return;
    }
    Req *q = tracked(w, r);
    int sync = (q->flags & RF_SYNC_RES) != 0, tpc = tokens_per_chunk(w);
    Kw kw;
    memset(&kw, 0, sizeof kw);
    kw.count = 1;
    kw.end_chunk = cdiv(hit, tpc);
    int last = kv_blocks_of(w->b, hit), per = n / w->b->groups;  /* the hit's blocks, its last maybe in part */
    int bpc = w->b->blocks_per_chunk, tail = w->b->partial_tails && hit % tpc != 0;
    if (FAULT(w, FT_TAIL_LOAD_ROUNDS_DOWN) && tail) last = kw.end_chunk = hit / tpc;
    for (int g = 0; g < w->b->groups; g++) {  /* group by group */
        const uint8_t *table = blocks + g * per;
        int first = 0;
        while (first < last && table[first] == NONE8) first++;
        if (first == last) continue;  /* none of the hit's blocks in this group */
        int c = first / bpc;
        for (; c < kw.end_chunk - tail; c++) {
            int key = chunk_key(w, r, c, g), read = 0;
            kw.keys |= (KeyMask)1 << key;
            for (int i = c * bpc; i < (c + 1) * bpc; i++)  /* the blocks of the chunk it reads */
                if (i >= first && i < last) read |= 1 << (i - c * bpc);
            if (w->s.partial[key] && (read & ~w->s.partial[key]))
                w->s.unwritten |= (KeyMask)1 << key;
            if (last <= c * bpc)  /* truth.placed: it copies no block of its own chunk */
                w->s.misplaced |= (KeyMask)1 << key;
        }
        if (tail) {  /* the boundary's key, last, into the block the boundary falls in */
            int key = kv_key(w->b, r, hit - 1, g);
            int position = (last < (c + 1) * bpc ? last : (c + 1) * bpc) - 1;
            kw.keys |= (KeyMask)1 << key;
            if (position / bpc != (hit - 1) / tpc) w->s.misplaced |= (KeyMask)1 << key;
        }
        for (int i = first; i < last; i++) kw.blocks[kw.nblocks++] = table[i];
    }
    kw.sync = sync;
    fire(w, M_REQUEST, r, sync ? RT_load_sync : RT_load_async, &kw);
}

static void store(World *w, int r, int scheduled);
static void store_boundaries(World *w, uint8_t sched, uint8_t resumed);
static void store_tails(World *w);
static void end_step(World *w);

/* extend_table: a flat table (group by group) with `grown` (a block per group, NONE8 in
 * the first: none) appended to each group's part */
static int extend_table(World *w, uint8_t *table, int n, const uint8_t *grown) {
    int ng = w->b->groups, per = n / ng;
    if (grown[0] == NONE8) return n;
    if (n + ng > MAXT) fail(w, ERR_LIMIT, "more than %d blocks", MAXT);
    for (int g = ng - 1; g >= 0; g--) {  /* from the last group down: each part moves up by g */
        for (int i = per - 1; i >= 0; i--) table[g * (per + 1) + i] = table[g * per + i];
        table[g * (per + 1) + per] = grown[g];
    }
    return n + ng;
}

/* _forget_reallocated_window_blocks: a window block the core freed and handed out again in
 * this step is stale in its old request's table: from the store cursor to the table's end
 * before the step extended it, it is nulled, so no store reads it (S:1533-1552); the table
 * of the request admitted in this step (`whole`) is new */
static void forget_reallocated_window_blocks(World *w, int whole, const uint8_t (*grown)[MAXG]) {
    if (!w->batch_alloc) return;
    int ng = w->b->groups, bpc = w->b->blocks_per_chunk;
    for (int r = 0; r < w->b->requests; r++) {
        Req *q = &w->s.req[r];
        if (!(q->flags & RF_TRACKED) || r == whole || !q->nblocks) continue;
        int per = q->nblocks / ng, end = per - (grown[r][0] != NONE8);
        for (int g = 0; g < ng; g++) {
            if (!is_window(w, g)) continue;
            for (int p = q->cursor * bpc; p < end; p++) {
                uint8_t *x = &q->blocks[g * per + p];
                if (*x != NONE8 && ((w->batch_alloc >> *x) & 1)) *x = NONE8;
            }
        }
    }
}

/* build_meta: build_connector_meta. `admitted` (or -1) is new with `nblocks` blocks; the
 * cached requests are `cached` (mask), in index order, each with the blocks its next token
 * added to its table (`grown`, a block per group; NONE8 in the first: none); `sched` lists
 * the scheduled ones in the order the core scheduled them (`scheduled`: the same, as a
 * mask); `resumed` (a mask) those whose
 * async load ended that the core's waiting loop reaches in this step (handoffs). */
static void build_meta(World *w, int admitted, const uint8_t *blocks, int nblocks,
                       uint8_t cached, const uint8_t (*grown)[MAXG], const int *sched,
                       int nsched, uint8_t scheduled, uint8_t finished, uint8_t preempted,
                       uint8_t resumed) {
    w->step_open = 1;
    for (int pass = 0; pass < 2; pass++)
        for (int r = 0; r < w->b->requests; r++) {
            int is_new = pass == 0 && r == admitted;
            int is_cached = pass == 1 && ((cached >> r) & 1);
            if (!is_new && !is_cached) continue;
            Req *cur = tracked(w, r);
            uint8_t table[MAXT];
            int ntable;
            if (is_new) {
                for (int i = 0; i < nblocks; i++)
                    if (blocks[i] != NONE8) w->batch_alloc |= (uint16_t)(1u << blocks[i]);
                memcpy(table, blocks, (size_t)nblocks);
                ntable = nblocks;
            } else {
                memcpy(table, cur->blocks, cur->nblocks);
                if (grown[r][0] != NONE8)
                    for (int g = 0; g < w->b->groups; g++) w->batch_alloc |= (uint16_t)(1u << grown[r][g]);
                ntable = extend_table(w, table, cur->nblocks, grown[r]);
            }
            if (IN(RS_SCHEDULED, cur->state)) {
                set_blocks(cur->blocks, &cur->nblocks, table, ntable);
            } else {  /* the table says from where a request may be scheduled */
                Kw kw;
                memset(&kw, 0, sizeof kw);
                kw.count = 1;
                copy_blocks(kw.blocks, table, ntable);
                kw.nblocks = ntable;
                fire(w, M_REQUEST, r, RT_schedule, &kw);
            }
        }
    if (windows(w->b)) {  /* the tokens computed once this step ran */
        for (int i = 0; i < nsched; i++) {
            Req *q = tracked(w, sched[i]);
            q->window_end = (uint8_t)(w->s.req[sched[i]].computed + 1);
        }
        forget_reallocated_window_blocks(w, admitted, grown);
    }
    for (int r = 0; r < w->b->requests; r++) {
        if (!((preempted >> r) & 1) || ((w->preempted_early >> r) & 1)) continue;
        Req *q = &w->s.req[r];
        if ((q->flags & RF_TRACKED) && IN(RS_PREEMPT_FLUSHED, q->state)) fire(w, M_REQUEST, r, RT_preempt, NULL);
    }
    for (int b = 0; b < MAXB; b++) {
        if (!((w->batch_alloc >> b) & 1)) continue;
        if (FAULT(w, FT_REALLOC_SKIPS_FENCE)) break;
        uint32_t ids = w->s.block_fence[b];
        for (int id = 0; id < MAXID; id++)
            if ((ids >> id) & 1 && live_job(w, id)) fire(w, M_JOB, id, JT_flush, NULL);
    }
    int limit = w->b->timeout_steps;
    if (limit >= 0) {
        int ids[MAXJ], n = 0;
        for (int i = 0; i < w->s.njobs; i++)
            if (w->s.job[i].flags & JF_TABLE) ids[n++] = w->s.job[i].id;
        for (int i = 0; i < n; i++) {
            Job *aged = live_job(w, ids[i]);
            if (aged && aged->age != NONE8 && aged->age >= limit) {
                failed_copy(w, ids[i]);  /* its data never confirmed */
                fire(w, M_JOB, ids[i], JT_time_out, NULL);
            }
        }
    }
    store_boundaries(w, scheduled, resumed);
    store_tails(w);
    for (int i = 0; i < nsched; i++) {
        int r = sched[i];
        Req *q = &w->s.req[r];
        if ((q->flags & RF_TRACKED) && IN(RS_STORE_CANDIDATES, q->state)) store(w, r, 1);
    }
    for (int r = 0; r < w->b->requests; r++) {
        if (!((finished >> r) & 1)) continue;
        Req *q = &w->s.req[r];
        if ((q->flags & RF_TRACKED) && IN(RS_STORE_CANDIDATES, q->state)) {
            int sched_here = 0;
            for (int i = 0; i < nsched; i++) sched_here |= sched[i] == r;
            store(w, r, sched_here);
        }
    }
    for (int id = 0; id < MAXID; id++) {
        if (!((w->batch_jobs >> id) & 1)) continue;
        Job *j = live_job(w, id);
        if (j && IN(JS_TO_SHIP, j->state)) fire(w, M_JOB, id, JT_ship, NULL);
    }
    for (int r = 0; r < w->b->requests; r++) {
        if (!((finished >> r) & 1)) continue;
        Req *q = &w->s.req[r];
        if ((q->flags & RF_TRACKED) && q->state == R_FINISHED_PENDING_FINAL) fire(w, M_REQUEST, r, RT_finalize, NULL);
    }
    end_step(w);
}

/* reachable_store_blocks: which of window group g's blocks start <= i < end a store may
 * need (bit i - start), because a hit at a chunk-aligned length reads them; -1: every block.
 * A window's tail per chunk (retention None), per retention interval, and (retention given)
 * at the replay boundary, the prompt's tokens less one. A tail counts the blocks the hit
 * that ends furthest before the chunk's edge reads (hit_tail_blocks: a block and, under
 * 0.33.0's cut, a token before it), unless the fault keeps vLLM's mask (finding F4). */
static int32_t reachable_store_blocks(const World *w, int g, int start, int end) {
    const Bounds *b = w->b;
    if (!is_sliding(w, g)) return -1;
    int tpb = b->tokens_per_block, tpc = tokens_per_chunk(w);
    int cut = tpb + !b->last_token_before_caps;
    int need = FAULT(w, FT_STORE_MASK_IGNORES_SHORT_HITS) ? cdiv(b->sliding_window - 1, tpb)
                                                         : cdiv(b->sliding_window - 1 + cut, tpb);
    int segment = b->retention < 0 ? tpc : b->retention;
    int32_t mask = 0;
    if (segment) {
        int per = segment / tpb;
        if (need >= per) return -1;
        for (int i = start; i < end; i++)
            if (i % per >= per - need) mask |= 1 << (i - start);
    }
    if (b->retention >= 0) {  /* reachable_boundaries: the replay boundary */
        int edge = (b->tokens - 1) / tpc * tpc / tpb;
        for (int i = start > edge - need ? start : edge - need; i < end && i < edge; i++)
            mask |= 1 << (i - start);
    }
    return mask;
}

/* chunk_store_blocks: the blocks a store copies of the chunk at `at` of a table, as offsets
 * within it (bit i: its i-th block), given which of them are reachable (-1: all); 0: the
 * chunk is not stored (its last block is null, none of it is reachable, or a reachable block
 * is null). A stored chunk copies every block it holds, so one whose leading blocks the core
 * freed is stored in part. */
static int chunk_store_blocks(const uint8_t *at, int bpc, int32_t reachable) {
    int full = (1 << bpc) - 1, held = 0;
    for (int i = 0; i < bpc; i++) held |= (at[i] != NONE8) << i;
    if (at[bpc - 1] == NONE8) return 0;
    if (reachable < 0) return held == full ? full : 0;
    reachable &= full;
    if (!reachable || (reachable & ~held)) return 0;
    return held;
}

/* _offloadable: `tokens` under the request's max_offload_tokens and, with
 * offload_prompt_only, its prompt's end (S:762-771) */
static int offloadable(const World *w, int r, int tokens) {
    if (w->b->max_offload[r] >= 0 && w->b->max_offload[r] < tokens) tokens = w->b->max_offload[r];
    if (w->b->offload_prompt_only && tokens > w->b->tokens) tokens = w->b->tokens;
    return tokens;
}

/* _prepare_store: the manager's prepare_store of the keys `offered` (M:254-336): those not
 * yet stored and admitted, marked write-pending, with room made by evicting unpinned chunks.
 * Returns 0 with them in *stored (none: 0), or -1: no room (store_alloc_failed fired). */
static int prepare_store(World *w, int r, KeyMask offered, KeyMask *stored) {
    Req *req = tracked(w, r);
    KeyMask candidates = 0;
    *stored = 0;
    for (int k = 0; k < MAXK; k++)
        if ((offered >> k) & 1 && w->s.chunk[k] == CH_ABSENT) candidates |= (KeyMask)1 << k;
    int threshold = w->b->store_threshold;
    if (threshold > 1 && offered) {  /* store admission (M:129-148, M:282-291) */
        KeyMask counted = 0;
        if (w->b->per_request_admission) {  /* once per request and generation (M@0.34.0:133-159) */
            counted = req->counted;
            req->counted |= offered;
        }
        for (int k = 0; k < MAXK; k++) {
            if (!((offered >> k) & 1)) continue;
            if (!((counted >> k) & 1) && w->s.offers[k] < threshold) w->s.offers[k]++;
            if (w->s.offers[k] < threshold) candidates &= ~((KeyMask)1 << k);
        }
    }
    if (!candidates) return 0;
    if (req->flags & RF_SIGNALED) req->after_signal++;
    int present = 0, held = 0;
    for (int c = 0; c < MAXK; c++) present += w->s.chunk[c] != CH_ABSENT;
    for (int i = 0; i < w->s.njobs; i++)
        if (w->s.job[i].flags & JF_HELD) held += w->s.job[i].held_slots;
    int need = popcount16(candidates) - (w->b->cpu_chunks - present - held);
    if (need > 0) {
        int pinned_ok = FAULT(w, FT_EVICT_PINNED_CHUNKS) != 0;
        int evictable[MAXK], ne = 0;
        for (int c = 0; c < MAXK; c++) {
            int8_t ref = w->s.chunk[c];
            if (ref == CH_ABSENT || ((offered >> c) & 1)) continue;
            if (ref == 0 || (pinned_ok && ref > 0)) evictable[ne++] = c;
        }
        if (need > ne) {
            fire(w, M_REQUEST, r, RT_store_alloc_failed, NULL);
            return -1;
        }
        for (int i = 0; i < need; i++) w->s.chunk[evictable[i]] = CH_ABSENT;
    }
    for (int k = 0; k < MAXK; k++)
        if ((candidates >> k) & 1) w->s.chunk[k] = -1;
    *stored = candidates;
    return 0;
}

/* _store: the store the request's new full chunks give, if any */
static void store(World *w, int r, int scheduled) {
    Req *req = tracked(w, r);
    if (req->flags & RF_LOAD_INVALID) return;
    Req snapshot = *req;
    const Req *core = &w->s.req[r];
    int T = w->b->tokens, all = num_tokens(w, r), tokens;
    /* a finished request's last sampled token is never computed */
    if (req->flags & RF_FINISHED) tokens = core->aborted ? core->computed : (T > all - 1 ? T : all - 1);
    else tokens = core->computed + scheduled;
    tokens = offloadable(w, r, tokens);
    int ng = w->b->groups, per = req->nblocks / ng;  /* each group's part of the table */
    int bpc = w->b->blocks_per_chunk, tpc = tokens_per_chunk(w);  /* its full chunks, in its table */
    int n = tokens / tpc;
    if (n > all / tpc) n = all / tpc;
    if (n > per / bpc) n = per / bpc;
    int start = req->cursor;
    if (start >= n) return;
    KeyMask offered = 0, stored;
    uint8_t copied[MAXG][MAXT];  /* each chunk's blocks the store copies (offsets; 0: none) */
    memset(copied, 0, sizeof copied);
    for (int g = 0; g < ng; g++) {  /* per group (S:1859-1982); a chunk a window left without
                                     * a block it needs is not offered (storable_chunks); a
                                     * Mamba group's table is not positional: it is stored
                                     * from the core's hand-offs (S:1904-1905) */
        if (is_mamba(w, g)) continue;
        int32_t reach = reachable_store_blocks(w, g, start * bpc, n * bpc);
        for (int c = start; c < n; c++) {
            int32_t mask = reach < 0 ? -1 : (reach >> ((c - start) * bpc));
            copied[g][c] = (uint8_t)chunk_store_blocks(&req->blocks[g * per + c * bpc], bpc, mask);
            if (copied[g][c]) offered |= (KeyMask)1 << chunk_key(w, r, c, g);
        }
    }
    if (prepare_store(w, r, offered, &stored) < 0) return;
    if (!stored) { req->cursor = (uint8_t)n; return; }
    Kw kw;
    memset(&kw, 0, sizeof kw);
    kw.count = 1;
    kw.keys = stored;
    for (int g = 0; g < ng; g++)
        for (int c = start; c < n; c++) {
            int key = chunk_key(w, r, c, g);
            if (!copied[g][c] || !((stored >> key) & 1)) continue;
            /* truth.written: whole, or the blocks it held (the store's row changes no chunk's
             * written blocks, so this may come before it fires) */
            w->s.partial[key] = copied[g][c] == (1 << bpc) - 1 ? 0 : copied[g][c];
            for (int i = 0; i < bpc; i++) {
                if (!((copied[g][c] >> i) & 1)) continue;
                uint8_t x = snapshot.blocks[g * per + c * bpc + i];
                kw.blocks[kw.nblocks++] = x;
                if (is_window(w, g)) kw.fenced |= (uint16_t)(1u << x);  /* the core may free it any step */
            }
        }
    kw.end_chunk = n;
    fire(w, M_REQUEST, r, RT_store, &kw);
}

/* stores_handoffs: whether the connector stores a hand-off of a request in `state`: the
 * table has a store row from there */
static int stores_handoffs(const World *w, int state) {
    const Tables *t = w->t;
    return t->index[t->start[M_REQUEST][RT_store * t->nstate[M_REQUEST] + state]] >= 0;
}

/* spec.groups.handoff_position: the block position of the Mamba state the core hands off
 * after a step that ends at `boundary` computed tokens (committed_state_position, if
 * state_retained at the replay boundary); -1: no hand-off */
static int handoff_position(const World *w, int boundary) {
    int tpb = w->b->tokens_per_block, retention = w->b->retention;
    if (boundary <= 0 || boundary % tpb) return -1;  /* no state committed inside a block */
    int position = (boundary - 1) / tpb;
    if (retention < 0) return position;
    int per = retention / tpb;
    if (retention && (per <= 1 || (position + 1) % per == 0)) return position;
    return position == (w->b->tokens - 1) / tpb - 1 ? position : -1;
}

/* handoffs and _store_boundaries: the Mamba states the core hands off in this step, for
 * each request it schedules (`sched`, a mask: the state after the step) or resumes after an
 * async load (`resumed`: the state the load ended on, first), in request order, each group
 * in order; one at a chunk boundary within the offloadable tokens becomes a store of its one
 * block into the chunk that ends there, fenced from the job's creation (S:1554-1624); the
 * store cursor stays */
static void store_boundaries(World *w, uint8_t sched, uint8_t resumed) {
    if (!w->b->mamba) return;
    int tpc = tokens_per_chunk(w), bpc = w->b->blocks_per_chunk, ng = w->b->groups;
    for (int r = 0; r < w->b->requests; r++) {
        if (!(((sched | resumed) >> r) & 1)) continue;
        Req *req = &w->s.req[r];  /* the core's view and the connector's, one record */
        int per = req->ncblocks / ng, ends[2], nends = 0;
        if ((resumed >> r) & 1) ends[nends++] = req->computed;
        if ((sched >> r) & 1) ends[nends++] = req->computed + 1;
        for (int e = 0; e < nends; e++) {
            int boundary = ends[e], position = handoff_position(w, boundary);
            /* a hand-off inside a chunk or past the offloadable tokens is not stored */
            if (position < 0 || boundary % tpc || boundary > offloadable(w, r, num_tokens(w, r)))
                continue;
            for (int g = 0; g < ng; g++) {
                if (!is_mamba(w, g)) continue;
                uint8_t block = req->cblocks[g * per + position];
                if (block == NONE8) continue;
                /* the request's state, read again for each: a store moves it */
                if (!(req->flags & RF_TRACKED) || !stores_handoffs(w, req->state) ||
                    (req->flags & RF_LOAD_INVALID))
                    continue;
                int key = chunk_key(w, r, boundary / tpc - 1, g);
                KeyMask stored;
                if (prepare_store(w, r, (KeyMask)1 << key, &stored) < 0 || !stored) continue;
                Kw kw;
                memset(&kw, 0, sizeof kw);
                kw.count = 1;
                kw.keys = stored;
                kw.nblocks = 1;
                kw.blocks[0] = block;
                if (!FAULT(w, FT_HANDOFF_STORE_SKIPS_FENCE)) kw.fenced = (uint16_t)(1u << block);
                kw.end_chunk = req->cursor;
                /* truth.written: the state fills its chunk's last block */
                w->s.partial[key] = bpc == 1 ? 0 : (uint8_t)(1u << (bpc - 1));
                fire(w, M_REQUEST, r, RT_store, &kw);
            }
        }
    }
}

/* Bounds.tail_boundary: the prompt's last hash boundary before its last token, when partial
 * tails are on and it falls inside a block; -1: none */
static int tail_boundary(const World *w) {
    int boundary = w->b->tokens - 1;
    if (!w->b->partial_tails || boundary <= 0 || boundary % w->b->tokens_per_block == 0) return -1;
    return boundary;
}

/* tail_handoffs: the partial tails the core hands off in this step. A request scheduled on
 * (`sched`, a mask; not the one admitted in this step, which loaded its tail or has none
 * computed) whose own steps reached its prompt's tail boundary committed its Mamba states
 * there; the core copies each on write into a fresh block from the free pool (a copy's
 * destination is allocated in the step) and hands that block off (w->tails, w->tail_copy);
 * with too few free blocks, none. Returns the copies' blocks (a mask), which go back to the
 * pool once the step is built. */
static uint16_t tail_handoffs(World *w, uint8_t sched, int admitted) {
    int boundary = tail_boundary(w), need = popcount16((uint32_t)w->b->mamba);
    uint16_t copies = 0;
    if (boundary < 0) return 0;
    for (int r = 0; r < w->b->requests; r++) {
        if (!((sched >> r) & 1) || r == admitted || w->s.req[r].computed != boundary) continue;
        if (popcount16(w->s.free_blocks) < need) continue;
        for (int g = 0; g < w->b->groups; g++) {
            if (!is_mamba(w, g)) continue;
            uint8_t copy = take_free_block(&w->s);
            w->tail_copy[r][g] = copy;
            w->batch_alloc |= (uint16_t)(1u << copy);
            copies |= (uint16_t)(1u << copy);
        }
        w->tails |= (uint8_t)(1u << r);
    }
    return copies;
}

/* _store_tails: a partial tail handed off becomes one store of every group's block the
 * boundary falls in (a Mamba group's copy, the others' table block), under the boundary's
 * keys, all fenced from the job's creation (S:1626-1760); none if a group's block is null or
 * the boundary is past the request's offloadable prompt tokens; the store cursor stays */
static void store_tails(World *w) {
    int boundary = tail_boundary(w), tpb = w->b->tokens_per_block, ng = w->b->groups;
    for (int r = 0; r < w->b->requests; r++) {
        if (!((w->tails >> r) & 1)) continue;
        Req *req = &w->s.req[r];
        if (!(req->flags & RF_TRACKED) || !stores_handoffs(w, req->state) ||
            (req->flags & RF_LOAD_INVALID))
            continue;
        if (boundary > offloadable(w, r, w->b->tokens)) continue;
        int position = boundary / tpb, per = req->nblocks / ng, whole = 1;
        KeyMask offered = 0, stored;
        uint8_t source[MAXG];
        for (int g = 0; g < ng && whole; g++) {
            if (is_mamba(w, g)) source[g] = w->tail_copy[r][g];
            else if (position >= per || req->blocks[g * per + position] == NONE8) whole = 0;
            else source[g] = req->blocks[g * per + position];
            offered |= (KeyMask)1 << kv_key(w->b, r, boundary - 1, g);
        }
        if (!whole || prepare_store(w, r, offered, &stored) < 0 || !stored) continue;
        Kw kw;
        memset(&kw, 0, sizeof kw);
        kw.count = 1;
        kw.keys = stored;
        for (int g = 0; g < ng; g++) {
            if (!((stored >> kv_key(w->b, r, boundary - 1, g)) & 1)) continue;
            kw.blocks[kw.nblocks++] = source[g];
            kw.fenced |= (uint16_t)(1u << source[g]);
        }
        kw.end_chunk = req->cursor;
        fire(w, M_REQUEST, r, RT_store, &kw);
    }
}

static void end_step(World *w) {
    State *s = &w->s;
    for (int i = 0; i < s->njobs; i++)
        if ((s->to_flush >> s->job[i].id) & 1) s->job[i].flags |= JF_FLUSH_SHIPPED;
    s->to_flush = 0;
    int limit = w->b->timeout_steps;
    for (int i = 0; i < s->njobs; i++) {
        Job *j = &s->job[i];
        if (!(j->flags & JF_TABLE) || j->age == NONE8) continue;
        j->age = (uint8_t)(limit > 0 ? (j->age + 1 < limit ? j->age + 1 : limit) : 1);
    }
    for (int r = 0; r < w->b->requests; r++) {
        Req *q = &s->req[r];
        if (q->flags & (RF_HIT | RF_SYNC_RES)) {
            q->flags &= (uint8_t)~(RF_HIT | RF_SYNC_RES);
            q->hit = 0;
        }
    }
    w->batch_jobs = w->batch_loads = 0;
    w->batch_alloc = 0;
    w->preempted_early = 0;
    s->reset_since_step = 0;
    w->step_open = 0;
}

/* report: update_connector_output for one job's reports */
static void report(World *w, int id, int done, int failed) {
    if (FAULT(w, FT_AGGREGATE_COUNTS_ONCE)) {
        if (done > 1) done = 1;
        if (failed > 1) failed = 1;
    }
    if (!live_job(w, id) && !held_job(w, id)) fail(w, ERR_MODEL, "job %d is due no report", id);
    Job *h = held_job(w, id);
    int stale = h && h->state == J_STALE;
    Kw kw;
    memset(&kw, 0, sizeof kw);
    if (done) { kw.count = done; fire(w, M_JOB, id, JT_ack, &kw); }
    if (failed) { kw.count = failed; fire(w, M_JOB, id, JT_fail, &kw); }
    if (stale) fire(w, M_FENCE, 0, FT_stale_report, NULL);
}

static void finish(World *w, int r) {
    Req *q = &w->s.req[r];
    if (!(q->flags & RF_TRACKED)) {
        fire(w, M_REQUEST, r, RT_finish_untracked, NULL);
        return;
    }
    q->flags |= RF_FINISHED;
    fire(w, M_REQUEST, r, RT_finish, NULL);
    if (FAULT(w, FT_SIGNAL_BEFORE_FINAL_STORE)) eff_signal_request_finished(w, r, NULL);
}

static void reset(World *w) {
    State *s = &w->s;
    int live = 0;
    for (int i = 0; i < s->njobs; i++)
        live += ((s->job[i].flags & JF_TABLE) != 0) +
                ((s->job[i].flags & JF_HELD) && s->job[i].state == J_TIMED_OUT);
    uint8_t reqs = 0;
    for (int r = 0; r < w->b->requests; r++)
        if (s->req[r].flags & RF_TRACKED) reqs |= (uint8_t)(1u << r);
    for (int r = 0; r < w->b->requests; r++) {
        if (!((reqs >> r) & 1)) continue;
        uint32_t held = s->req[r].jobs;
        if (held && FAULT(w, FT_RESET_KEEPS_TRANSFER_JOBS)) {  /* vLLM before PR #48102 */
            for (int id = 0; id < MAXID; id++)
                if ((held >> id) & 1 && live_job(w, id)) fire(w, M_JOB, id, JT_reset, NULL);
            s->req[r].cursor = 0;  /* S:2429-2433 did that */
            s->req[r].hit = 0;
            s->req[r].flags &= (uint8_t)~RF_HIT;
            continue;
        }
        fire(w, M_REQUEST, r, RT_reset, NULL);
    }
    int ids[MAXJ], n = 0;
    for (int i = 0; i < s->njobs; i++)
        if ((s->job[i].flags & JF_HELD) && s->job[i].state == J_TIMED_OUT) ids[n++] = s->job[i].id;
    for (int i = 0; i < n; i++) fire(w, M_JOB, ids[i], JT_reset, NULL);
    for (int c = 0; c < MAXK; c++) s->chunk[c] = CH_ABSENT;
    for (int r = 0; r < MAXR; r++) s->req[r].counted = 0;  /* a new generation (M@0.34.0:161-172) */
    if (!FAULT(w, FT_RESET_KEEPS_STALE_THRESHOLD)) s->threshold = s->counter;
    Kw kw;
    memset(&kw, 0, sizeof kw);
    kw.count = 1;
    kw.live_jobs = live;
    fire(w, M_FENCE, 0, FT_reset, &kw);
    s->being_loaded = 0;
    memset(s->block_fence, 0, sizeof s->block_fence);
    s->reset_since_step = 1;
}

/* ============================================================== the core (core.py) */
static void core_free(World *w, const uint8_t *blocks, int n) {
    uint16_t quarantined = 0;
    for (int i = 0; i < w->s.njobs; i++) {
        const Job *j = &w->s.job[i];
        if (j->flags & JF_QUAR)
            for (int k = 0; k < j->nblocks; k++) quarantined |= (uint16_t)(1u << j->blocks[k]);
    }
    for (int i = 0; i < n; i++)
        if (blocks[i] != NONE8 && !((quarantined >> blocks[i]) & 1))
            w->s.free_blocks |= (uint16_t)(1u << blocks[i]);
}

/* _free_before_window: the core frees a running request's window-group blocks that fell out
 * of the window of its computed tokens (remove_skipped_blocks) */
static void free_before_window(World *w) {
    if (!windows(w->b)) return;
    for (int r = 0; r < w->b->requests; r++) {
        Req *c = &w->s.req[r];
        if (c->cstatus != C_RUNNING || !c->ncblocks) continue;
        uint8_t freed[MAXT];
        int n = 0;
        for (int i = 0; i < c->ncblocks; i++)
            if (c->cblocks[i] != NONE8 && kv_freed_position(w->b, c->ncblocks, i, c->computed)) {
                freed[n++] = c->cblocks[i];
                c->cblocks[i] = NONE8;
            }
        core_free(w, freed, n);
    }
}

static void core_reset(Req *q, int status) {  /* MCore(status) */
    q->cstatus = (uint8_t)status;
    q->computed = q->loading = q->aborted = q->ncblocks = q->ckv_bad = q->crecv_failed = 0;
    q->cpromoted = 0;
    q->cload = NONE8;
    memset(q->cblocks, 0, MAXT);
}

/* _name_in_failed_recving: under StaleLoadFailure.FENCE_ONLY the worker's failed_recving
 * tells the core that the async load its request waits for failed */
static void name_in_failed_recving(World *w, const Job *load) {
    if (!w->b->stale_fence_only || load->kind != KIND_LOAD || (load->flags & JF_SYNC)) return;
    Req *q = &w->s.req[load->owner];
    if (q->cstatus == C_REMOTE && q->cload == load->id) q->crecv_failed = 1;
}

static void follow_connector(World *w) {
    for (int r = 0; r < w->b->requests; r++) {
        Req *q = &w->s.req[r];
        if (q->cstatus == C_NONE) continue;
        int state = (q->flags & RF_TRACKED) ? q->state : R_ABSENT;
        if (q->cstatus == C_REMOTE) {
            if (state == R_IDLE && !q->crecv_failed) {
                q->cstatus = C_WAITING;
                q->computed = q->loading;
                q->loading = 0;
            } else if (IN(RS_MUST_RECOMPUTE, state) || state == R_IDLE) {
                core_free(w, q->cblocks, q->ncblocks);
                core_reset(q, C_WAITING);
            }
        } else if (q->cstatus == C_RUNNING) {
            if (IN(RS_PREEMPTED_IF_RUNNING, state)) {
                core_free(w, q->cblocks, q->ncblocks);
                core_reset(q, C_WAITING);
            }
        } else if (q->cstatus == C_FINISHED && q->ncblocks) {
            int loading = 0;
            if (q->flags & RF_TRACKED)
                for (int id = 0; id < MAXID; id++) {
                    Job *j = (q->jobs >> id) & 1 ? live_job(w, id) : NULL;
                    if (j && j->kind == KIND_LOAD) loading = 1;
                }
            if (!loading) {
                core_free(w, q->cblocks, q->ncblocks);
                memset(q->cblocks, 0, MAXT);
                q->ncblocks = 0;
            }
        }
    }
}

/* ============================================================== the environment */
void kv_initial(const Bounds *b, State *s) {
    memset(s, 0, sizeof *s);
    s->fence = F_FENCE_IDLE;
    for (int c = 0; c < MAXK; c++) s->chunk[c] = CH_ABSENT;
    s->free_blocks = (uint16_t)((1u << b->gpu_blocks) - 1);
    for (int r = 0; r < MAXR; r++) s->req[r].cload = NONE8;
}

static int behind_a_sync_load(const State *s, const Job *j) {
    for (int i = 0; i < s->njobs; i++) {
        const Job *o = &s->job[i];
        if (o->owner == j->owner && o->kind == KIND_LOAD && (o->flags & JF_SYNC) && o->id < j->id &&
            o->unreported > 0)
            return 1;
    }
    return 0;
}

/* spec.request.recving_is_stale: a newer async load of the request than the one completed
 * still has reports due (live, quarantined or fenced), so the finished_recving naming it came
 * from an older, timed-out load */
static int recving_is_stale(const State *s, int owner, int completed) {
    for (int i = 0; i < s->njobs; i++) {
        const Job *j = &s->job[i];
        if ((j->flags & (JF_TABLE | JF_HELD)) && j->owner == owner && j->kind == KIND_LOAD &&
            !(j->flags & JF_SYNC) && j->id > completed)
            return 1;
    }
    return 0;
}

/* apply one event to w->s (thawed); raises through w->jb */
static void apply(World *w, uint32_t ev) {
    const Bounds *b = w->b;
    State *s = &w->s;
    int kind = EV_KIND(ev), r = EV_REQ(ev);
    if (kind == EV_ARRIVE) {
        if (s->req[r].cstatus != C_NONE) fail(w, ERR_NOT_ENABLED, "already arrived");
        core_reset(&s->req[r], C_WAITING);
        fire(w, M_REQUEST, r, RT_add, NULL);
    } else if (kind == EV_STEP) {
        int admitted = -1, sched[MAXR], nsched = 0, nblocks = 0;
        int ng = b->groups;
        uint8_t blocks[MAXT], cached = 0, grown[MAXR][MAXG], resumed = 0;
        memset(grown, NONE8, sizeof grown);
        if (EV_PROMOTE(ev)) {
            /* the core's waiting loop reaches a request whose async load ended, caches the
             * loaded blocks (handing off their state) but does not schedule it in this step
             * (no budget, no room); it admits no one else */
            Req *c = &s->req[r];
            if (!b->mamba) fail(w, ERR_NOT_ENABLED, "no hand-off groups");
            if (c->cstatus != C_WAITING || !c->ncblocks || c->cpromoted)
                fail(w, ERR_NOT_ENABLED, "no loaded request to promote");
            c->cpromoted = 1;
            resumed = (uint8_t)(1u << r);
        } else if (EV_ADMIT(ev)) {
            Req *c = &s->req[r];
            if (c->cstatus != C_WAITING) fail(w, ERR_NOT_ENABLED, "not waiting");
            if (!c->ncblocks) {
                int is_async;
                int hit = lookup(w, r, &is_async);
                inside(w, 0);
                /* _allocation: a block per tokens_per_block tokens in each group, none before
                 * a window group's window of the first token to compute (of one token less
                 * after a short hit) */
                int per = kv_blocks_of(w->b, num_tokens(w, r)), need = 0;
                int from = hit > w->short_hit ? hit - w->short_hit : 0;
                for (int g = 0; g < ng; g++)
                    for (int p = 0; p < per; p++) {
                        int null = p < kv_skipped_blocks(b, g, from);
                        blocks[nblocks++] = null ? NONE8 : 0;
                        need += !null;
                    }
                if (hit >= 0 && popcount16(s->free_blocks) >= need) {
                    for (int i = 0; i < nblocks; i++)
                        if (blocks[i] != NONE8) blocks[i] = take_free_block(s);
                    alloc(w, r, blocks, nblocks, hit);
                    inside(w, 1);
                    c = &s->req[r];
                    uint8_t loader = hit > 0 ? (uint8_t)w->last_job : NONE8;  /* the load just created */
                    if (hit && is_async) {
                        core_reset(c, C_REMOTE);
                        memcpy(c->cblocks, blocks, (size_t)nblocks);
                        c->ncblocks = (uint8_t)nblocks;
                        c->loading = (uint8_t)hit;
                        c->cload = loader;
                    } else {
                        core_reset(c, C_RUNNING);
                        c->computed = (uint8_t)hit;
                        memcpy(c->cblocks, blocks, (size_t)nblocks);
                        c->ncblocks = (uint8_t)nblocks;
                        c->cload = loader;
                        admitted = r;
                        sched[nsched++] = r;
                    }
                }
            } else {  /* an async load ended: it runs now, without a lookup */
                c->cstatus = C_RUNNING;
                if (!c->cpromoted) resumed = (uint8_t)(1u << r);  /* the core caches the loaded blocks now */
                c->cpromoted = 0;
                memcpy(blocks, c->cblocks, c->ncblocks);
                nblocks = c->ncblocks;
                admitted = r;
                sched[nsched++] = r;
            }
        }
        for (int q = 0; q < b->requests; q++) {
            Req *c = &s->req[q];
            if (c->cstatus == C_RUNNING && q != admitted && c->computed < tokens_to_compute(w, q)) {
                if (kv_blocks_of(w->b, c->computed + 1) > c->ncblocks / ng) {  /* _decode_blocks: its next token's block, in each group */
                    if (popcount16(s->free_blocks) < ng) continue;  /* no room: not scheduled in this step */
                    for (int g = 0; g < ng; g++) grown[q][g] = take_free_block(s);
                    c->ncblocks = (uint8_t)extend_table(w, c->cblocks, c->ncblocks, grown[q]);
                }
                cached |= (uint8_t)(1u << q);
                sched[nsched++] = q;
            }
        }
        uint8_t scheduled = 0;
        for (int i = 0; i < nsched; i++) scheduled |= (uint8_t)(1u << sched[i]);
        uint16_t copies = tail_handoffs(w, scheduled, admitted);
        build_meta(w, admitted, blocks, nblocks, cached, grown, sched, nsched, scheduled,
                   s->pending_finished, s->pending_preempted, resumed);
        if (copies) {  /* the copies' blocks go back to the pool once the step is built */
            uint8_t freed[MAXB];
            int nf = 0;
            for (int blk = 0; blk < MAXB; blk++)
                if ((copies >> blk) & 1) freed[nf++] = (uint8_t)blk;
            core_free(w, freed, nf);
        }
        for (int i = 0; i < nsched; i++) {
            Req *c = &s->req[sched[i]];
            int all = num_tokens(w, sched[i]);
            c->computed = (uint8_t)(c->computed + 1 < all ? c->computed + 1 : all);
            sample(w, sched[i]);
        }
        free_before_window(w);
        s->pending_finished = s->pending_preempted = 0;
        follow_connector(w);
    } else if (kind == EV_REPORT || kind == EV_STRAY) {
        int id = EV_JOB(ev), count = EV_COUNT(ev), failed = EV_FAILED(ev);
        if (id < s->threshold && !held_job(w, id)) {
            if (!b->stray_reports) fail(w, ERR_NOT_ENABLED, "no stray reports");
            Kw kw;
            memset(&kw, 0, sizeof kw);
            kw.count = count;
            fire(w, M_FENCE, 0, FT_drained_report, &kw);
            return;
        }
        Job *due = live_job(w, id);
        if (!due) due = held_job(w, id);
        if (!due || (due->age == NONE8 && (due->flags & JF_TABLE))) fail(w, ERR_NOT_ENABLED, "not shipped");
        if (count < 1 || count > due->unreported) fail(w, ERR_NOT_ENABLED, "count");
        if (behind_a_sync_load(s, due)) fail(w, ERR_NOT_ENABLED, "behind a sync load");
        if (count > due->pending)
            fail(w, ERR_MODEL, "job %d: %d reports from the workers but only %d due by the "
                 "scheduler's count (over-ack)", id, count, due->pending);
        if (failed) {
            if (s->budget[1] >= b->failures) fail(w, ERR_NOT_ENABLED, "failure budget");
            s->budget[1]++;
        }
        int owner = due->owner;
        int completes = count == due->unreported && due->kind == KIND_LOAD && !(due->flags & JF_SYNC);
        if (failed) {
            failed_copy(w, id);  /* before the connector hears of it */
            name_in_failed_recving(w, due);
        }
        report(w, id, failed ? 0 : count, failed ? count : 0);
        int i = job_pos(s, id);
        if (i >= 0) s->job[i].unreported = (uint8_t)(s->job[i].unreported - count);
        int cs = s->req[owner].cstatus;
        int recving = completes && (cs == C_REMOTE || cs == C_FINISHED);
        if (recving && (s->req[owner].flags & RF_TRACKED) && s->req[owner].state == R_ORPHANED_LOAD &&
            (FAULT(w, FT_STALE_RECVING_PROMOTES) || !recving_is_stale(s, owner, id)))
            fire(w, M_REQUEST, owner, RT_load_recving, NULL);
        follow_connector(w);
    } else if (kind == EV_ABORT && s->req[r].cstatus == C_NONE) {
        core_reset(&s->req[r], C_FINISHED);
        s->req[r].aborted = 1;
        finish(w, r);
    } else if (kind == EV_FINISH || kind == EV_ABORT) {
        Req *c = &s->req[r];
        if (c->cstatus == C_NONE || c->cstatus == C_FINISHED) fail(w, ERR_NOT_ENABLED, "not live");
        if (kind == EV_FINISH && !may_finish(w, r)) fail(w, ERR_NOT_ENABLED, "not done");
        int keep = c->cstatus == C_REMOTE;
        uint8_t computed = c->computed, blocks2[MAXT], n2 = c->ncblocks;
        uint8_t kv_bad = c->ckv_bad, loader = c->cload, promoted = c->cpromoted;
        memcpy(blocks2, c->cblocks, MAXT);
        if (!keep) core_free(w, blocks2, n2);
        core_reset(c, C_FINISHED);
        c->computed = computed;
        c->ckv_bad = kv_bad;
        c->cload = loader;
        c->cpromoted = promoted;
        if (keep) { memcpy(c->cblocks, blocks2, MAXT); c->ncblocks = n2; }
        c->aborted = kind == EV_ABORT;
        finish(w, r);
        s->pending_finished |= (uint8_t)(1u << r);
    } else if (kind == EV_PREEMPT) {
        Req *c = &s->req[r];
        if (c->cstatus != C_RUNNING) fail(w, ERR_NOT_ENABLED, "not running");
        if (sampled_last(w, r)) fail(w, ERR_NOT_ENABLED, "sampled its last token: it finishes");
        if (s->budget[2] >= b->preemptions) fail(w, ERR_NOT_ENABLED, "preemption budget");
        s->budget[2]++;
        core_free(w, c->cblocks, c->ncblocks);
        core_reset(c, C_WAITING);
        s->pending_preempted |= (uint8_t)(1u << r);
    } else if (kind == EV_RESET) {
        if (s->budget[0] >= b->resets) fail(w, ERR_NOT_ENABLED, "reset budget");
        s->budget[0]++;
        reset(w);
        follow_connector(w);
    }
}

/* events(s): every event the environment may send, in spec.model's order (none that needs a
 * spent budget) */
int kv_events(const Bounds *b, const State *s, uint32_t *out) {
    int n = 0;
    for (int r = 0; r < b->requests; r++)
        if (s->req[r].cstatus == C_NONE) {
            out[n++] = EV(EV_ARRIVE, r, 0, 0, 0, 0);
            out[n++] = EV(EV_ABORT, r, 0, 0, 0, 0);
        }
    out[n++] = EV(EV_STEP, 0, 0, 0, 0, 0);
    for (int r = 0; r < b->requests; r++) {
        const Req *c = &s->req[r];
        if (c->cstatus == C_NONE) continue;
        if (c->cstatus == C_WAITING) {
            out[n++] = EV(EV_STEP, r, 0, 0, 0, 1);
            if (c->ncblocks && !c->cpromoted && b->mamba) out[n++] = EV_PROMOTING(r);
        }
        if (c->cstatus == C_RUNNING) {
            if (c->computed >= b->tokens) out[n++] = EV(EV_FINISH, r, 0, 0, 0, 0);
            if (s->budget[2] < b->preemptions) out[n++] = EV(EV_PREEMPT, r, 0, 0, 0, 0);
        }
        if (c->cstatus != C_FINISHED) out[n++] = EV(EV_ABORT, r, 0, 0, 0, 0);
    }
    for (int pass = 0; pass < 2; pass++)  /* the table's jobs, then the held ones */
        for (int i = 0; i < s->njobs; i++) {
            const Job *j = &s->job[i];
            if (!(j->flags & (pass ? JF_HELD : JF_TABLE))) continue;
            if (j->age == NONE8 && !((JS_HELD >> j->state) & 1)) continue;
            if (j->unreported == 0) continue;
            int counts[2], nc = 0;
            if (b->partial_reports && j->unreported > 1) counts[nc++] = 1;
            counts[nc++] = j->unreported;
            for (int k = 0; k < nc; k++) {
                out[n++] = EV(EV_REPORT, 0, j->id, counts[k], 0, 0);
                if (s->budget[1] < b->failures) out[n++] = EV(EV_REPORT, 0, j->id, counts[k], 1, 0);
            }
        }
    if (b->stray_reports)
        for (int id = 0; id < s->threshold; id++) {
            int held = 0;
            for (int i = 0; i < s->njobs; i++) held |= (s->job[i].flags & JF_HELD) && s->job[i].id == id;
            if (!held) { out[n++] = EV(EV_STRAY, 0, id, 1, 0, 0); break; }
        }
    if (s->budget[0] < b->resets) out[n++] = EV(EV_RESET, 0, 0, 0, 0, 0);
    return n;
}

int kv_apply(const Bounds *b, const Tables *t, uint32_t faults, const State *s, uint32_t ev,
             State *out, uint64_t *fired, uint64_t stamp, int check_inside, uint32_t without,
             int *inside_inv, int *inside_hook, char *msg) {
    World w;
    jmp_buf jb;
    memset(&w, 0, offsetof(World, s));
    w.b = b;
    w.t = t;
    w.faults = faults;
    kv_copy_state(&w.s, s);
    w.jb = &jb;
    w.fired = fired;
    w.stamp = stamp;
    w.check_inside = check_inside;
    w.without = without;
    w.last_job = -1;
    if (setjmp(jb)) {
        if (msg) memcpy(msg, w.msg, sizeof w.msg);
        return w.err;
    }
    apply(&w, ev);
    KeyMask present = 0;  /* World.freeze: the truth of chunks the manager no longer holds */
    for (int c = 0; c < MAXK; c++) {
        if (w.s.chunk[c] != CH_ABSENT) present |= (KeyMask)1 << c;
        else w.s.partial[c] = 0;
    }
    w.s.bad_chunks &= present;
    kv_copy_state(out, &w.s);
    if (inside_inv) *inside_inv = w.inside_found ? w.inside_inv : -1;
    if (inside_hook) *inside_hook = w.inside_hook;
    return ERR_NONE;
}

/* ============================================================== canonical (projection.py) */
void kv_canonical(State *s) {
    uint32_t known = 0, ids = 0;
    for (int i = 0; i < s->njobs; i++) known |= 1u << s->job[i].id;
    ids = known | s->to_flush;
    for (int r = 0; r < MAXR; r++) ids |= s->req[r].jobs;
    for (int b = 0; b < MAXB; b++) ids |= s->block_fence[b];
    int n = __builtin_popcount(ids);
    int below = __builtin_popcount(ids & (s->threshold >= 32 ? ~0u : (1u << s->threshold) - 1));
    int dangling = 0;
    for (int r = 0; r < MAXR; r++) {
        if ((s->req[r].flags & RF_KVLOAD) && !((known >> s->req[r].kv_load) & 1)) dangling = 1;
        if (s->req[r].cload != NONE8 && !((known >> s->req[r].cload) & 1)) dangling = 1;
    }
    if (ids == (n == 32 ? ~0u : (1u << n) - 1) && s->counter == n && s->threshold == below &&
        !dangling)
        return;  /* already dense */
    int ren[MAXID];
    for (int id = 0, k = 0; id < MAXID; id++) ren[id] = (ids >> id) & 1 ? k++ : -1;
    for (int i = 0; i < s->njobs; i++) s->job[i].id = (uint8_t)ren[s->job[i].id];
#define REMAP(mask) do { uint32_t m_ = (mask), o_ = 0; \
        while (m_) { int id_ = __builtin_ctz(m_); m_ &= m_ - 1; o_ |= 1u << ren[id_]; } \
        (mask) = o_; } while (0)
    for (int r = 0; r < MAXR; r++) {
        Req *q = &s->req[r];
        REMAP(q->jobs);
        if (q->cload != NONE8)
            q->cload = (known >> q->cload) & 1 ? (uint8_t)ren[q->cload] : NONE8;
        if (q->flags & RF_KVLOAD) {
            if ((known >> q->kv_load) & 1) q->kv_load = (uint8_t)ren[q->kv_load];
            else { q->flags &= (uint8_t)~RF_KVLOAD; q->kv_load = 0; }
        }
    }
    REMAP(s->to_flush);
    for (int b = 0; b < MAXB; b++) REMAP(s->block_fence[b]);
#undef REMAP
    s->counter = (uint8_t)n;
    s->threshold = (uint8_t)below;
}
