// llama-kvp-stage.h - the stages a policy is composed of (one slot each: budget, score, schedule, fate, prefill).
//
// A stage is one decision of a policy. Each implementation lives in one file under native/engine/stages/ with its
// name, the keys it reads, its defaults, the validation of its keys and its behaviour; llama-kvp-stages.cpp lists
// them. The per-layer memory (llama-kvp-memory.cpp) and the observation (llama-kvp-observe.cpp) call the stages of a
// policy through the slot interfaces below and never ask which policy they run.
#pragma once

#include "llama-kvp.h"

#include "llama.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

class llama_kv_cache;
struct llama_kvp_context;
struct llm_graph_context;
struct ggml_tensor;

struct llama_kvp_stage {
    llama_kvp_stage(int32_t id, int32_t slot, const char * name, const char * keys, const char * help) :
        id(id), slot(slot), name(name), keys(keys), help(help) {}
    virtual ~llama_kvp_stage() = default;

    const int32_t      id;   // enum llama_kvp_stage_id
    const int32_t      slot; // enum llama_kvp_slot
    const char * const name; // its name in the spec grammar
    const char * const keys; // the keys it reads, comma-separated
    const char * const help; // one line

    // its defaults of the keys it reads (a spec part "+name" applies them to the keys the preset does not expose)
    virtual void defaults(llama_kvp_policy & p) const { (void) p; }

    // "" if the keys it reads are valid, else the reason (the caller prefixes the policy's name)
    virtual std::string check(const llama_kvp_policy & p) const { (void) p; return ""; }
};

//
// slot interfaces
//

struct llama_kvp_budget_stage : llama_kvp_stage {
    using llama_kvp_stage::llama_kvp_stage;

    // per-layer budgets before anything is observed, `mean` per layer on average; lo: the smallest useful layer
    // budget (the protected tokens + 1), hi: the context size
    virtual std::vector<uint32_t> initial(const llama_kvp_policy & p, uint32_t mean, int32_t n_layer, uint32_t lo, uint32_t hi) const;

    // does it decide the budgets from the attention entropy of the prompt
    virtual bool uses_entropy() const { return false; }

    // budgets from the mean head entropy of each layer (prompt observations so far); false: keep the current ones
    virtual bool from_entropy(const llama_kvp_policy & p, const float * entropy, int32_t n_layer, uint32_t mean,
                              uint32_t lo, uint32_t hi, std::vector<uint32_t> & out) const;
};

// a cell of a layer's cache, in the order of positions, with its eviction score (and, for a score stage that uses
// values, the norm of the token's value vectors, mean over the KV heads)
struct llama_kvp_cell {
    llama_pos pos;
    uint32_t  idx;
    float     score;
    float     value = 1.0f;
    float     last  = 0.0f; // for a score stage that uses it: the mass of the last observation alone (score: decayed)
};

struct llama_kvp_score_stage : llama_kvp_stage {
    using llama_kvp_stage::llama_kvp_stage;

    // does scoring need the in-graph observation of attention
    virtual bool observes() const = 0;

    // does scoring need the value norm of each cell (llama_kvp_cell::value)
    virtual bool uses_values(const llama_kvp_policy & p) const { (void) p; return false; }

    // does scoring need the last observation's mass of each cell apart from the decayed sum (llama_kvp_cell::last)
    virtual bool uses_last(const llama_kvp_policy & p) const { (void) p; return false; }

    // the tokens always kept by a layer with this budget: the first n_sink and the last n_recent
    virtual void protect(const llama_kvp_policy & p, uint32_t budget, uint32_t & n_sink, uint32_t & n_recent) const;

    // tokens always kept, whatever the budget (validation, smallest budgets)
    virtual int32_t n_protected(const llama_kvp_policy & p) const { return p.n_sink + p.n_recent; }

    // a budget made of protected tokens only (nothing is chosen by score)
    virtual bool protected_only() const { return false; }

    // turns the observed (accumulated, decayed) mass of each cell of KV layer il (of n_layer), in cells[].score (0:
    // not observed), into the eviction scores; cells are in position order, and of the middle ones, cells[i0, i1),
    // the n_topk best-scored will be kept
    virtual void score(const llama_kvp_policy & p, int32_t il, int32_t n_layer, uint32_t i0, uint32_t i1, uint32_t n_topk,
                       std::vector<llama_kvp_cell> & cells) const {
        (void) p; (void) il; (void) n_layer; (void) i0; (void) i1; (void) n_topk; (void) cells;
    }
};

// per-layer state a stage keeps between ubatches (the fate and schedule stages': owned by the per-layer memory; the
// prefill stage's: by the observation's layer, llama_kvp_obs_layer::prefill_state)
struct llama_kvp_layer_state {
    virtual ~llama_kvp_layer_state() = default;
};

class llama_kvp_memory;

struct llama_kvp_schedule_stage : llama_kvp_stage {
    using llama_kvp_stage::llama_kvp_stage;

    // does the single-token decode step number n_decode (0-based) refresh the scores
    virtual bool observe_step(const llama_kvp_policy & p, int32_t n_decode) const = 0;

    // does the single-token decode step number n_decode (0-based) evict down to the budgets (a step without room
    // evicts whatever this says)
    virtual bool evict_step(const llama_kvp_policy & p, int32_t n_decode) const { (void) p; (void) n_decode; return true; }

    // before a single-token decode step, ahead of the budget's eviction: may move tokens between the layer caches
    // and the host tier (freeze)
    virtual void before_step(llama_kvp_memory & mem) const { (void) mem; }

    // the positions [p0, p1) of the sequence were removed (p1 < 0: to its end)
    virtual void forget(llama_kvp_memory & mem, llama_pos p0, llama_pos p1) const { (void) mem; (void) p0; (void) p1; }

    // what a saved state holds of the stage's own state of KV layer ikv (nothing by default), and its restoration
    virtual void state_write(const llama_kvp_memory & mem, int32_t ikv, std::vector<uint8_t> & out) const { (void) mem; (void) ikv; (void) out; }
    virtual void state_read (llama_kvp_memory & mem, int32_t ikv, const std::vector<uint8_t> & in) const { (void) mem; (void) ikv; (void) in; }
};

// appends n bytes at x to a stage's saved state (state_write)
static inline void llama_kvp_state_put(std::vector<uint8_t> & out, const void * x, size_t n) {
    out.insert(out.end(), (const uint8_t *) x, (const uint8_t *) x + n);
}

// copies the next n bytes of a saved state (from off, which advances) to x; throws naming what if the state is shorter
static inline void llama_kvp_state_get(const std::vector<uint8_t> & in, size_t & off, void * x, size_t n, const char * what) {
    if (n > in.size() - std::min(off, in.size())) {
        throw std::runtime_error(std::string("pykvcache: corrupt ") + what + " in the state");
    }
    memcpy(x, in.data() + off, n);
    off += n;
}

// a vector in a saved state: its length, then its elements (put appends it, get reads it at off, which advances;
// throws naming what if the state is shorter)
template <typename T>
static void llama_kvp_state_put_vec(std::vector<uint8_t> & out, const std::vector<T> & v) {
    const uint64_t n = v.size();
    llama_kvp_state_put(out, &n, sizeof(n));
    llama_kvp_state_put(out, v.data(), n*sizeof(T));
}

template <typename T>
static void llama_kvp_state_get_vec(const std::vector<uint8_t> & in, size_t & off, std::vector<T> & v, const char * what) {
    uint64_t n = 0;
    llama_kvp_state_get(in, off, &n, sizeof(n), what);
    if (n > (in.size() - off)/sizeof(T)) {
        throw std::runtime_error(std::string("pykvcache: corrupt ") + what + " in the state");
    }
    v.resize(n);
    llama_kvp_state_get(in, off, v.data(), n*sizeof(T), what);
}

struct llama_kvp_fate_stage : llama_kvp_stage {
    using llama_kvp_stage::llama_kvp_stage;

    // "" if the policy can run on this model and context (checked when the memory is created)
    virtual std::string check_model(const llama_kvp_policy & p, int32_t n_embd_head, uint32_t n_ctx_seq) const {
        (void) p; (void) n_embd_head; (void) n_ctx_seq; return "";
    }

    // cells the stage puts back into KV layer ikv when n_leaving more tokens leave it (e.g. centroids)
    virtual uint32_t n_added(const llama_kvp_memory & mem, int32_t ikv, uint32_t n_leaving) const { (void) mem; (void) ikv; (void) n_leaving; return 0; }

    // the tokens in `leaving` (cells of KV layer ikv, in position order) leave it (one call per layer and eviction);
    // the stage frees their cells and may fill free cells with its own (at most n_added of them)
    virtual void leave(llama_kvp_memory & mem, int32_t ikv, const std::vector<llama_kvp_cell> & leaving) const = 0;

    // after the score stage, before the middle cells[i0, i1) of KV layer ikv are ranked: may change their eviction
    // scores (summarise: which tokens leave by how well a centroid stands for them)
    virtual void rescore(const llama_kvp_memory & mem, int32_t ikv, uint32_t i0, uint32_t i1, std::vector<llama_kvp_cell> & cells) const {
        (void) mem; (void) ikv; (void) i0; (void) i1; (void) cells;
    }

    // whether rescore reads the window queries' entropy of each token (llama_kvp_obs_layer_query_entropy)
    virtual bool uses_query_entropy(const llama_kvp_policy & p) const { (void) p; return false; }

    // KV layer ikv is about to be reallocated (its cells move): reads the stage deferred from leave must happen now
    virtual void before_resize(llama_kvp_memory & mem, int32_t ikv) const { (void) mem; (void) ikv; }

    // called once after every layer's eviction of a step: work the stage deferred in leave, done for all layers at
    // once (summarise reads every layer's leavers in one gather, then fits the bins that closed, in parallel)
    virtual void after_evictions(llama_kvp_memory & mem) const { (void) mem; }

    // whether the layers evict down to their budgets as soon as a prompt has been computed (a ubatch of 2+ tokens whose
    // last gives logits) rather than at the next step: the work on the prompt's last leavers then belongs to the prompt
    virtual bool settles_prompt_end() const { return false; }

    // the positions [p0, p1) of the sequence were removed (p1 < 0: to its end)
    virtual void forget(llama_kvp_memory & mem, llama_pos p0, llama_pos p1) const { (void) mem; (void) p0; (void) p1; }

    // what a saved state holds of the stage's tokens of KV layer ikv (nothing by default), and its restoration into
    // an emptied stage (throws std::runtime_error on data it cannot take)
    virtual void state_write(const llama_kvp_memory & mem, int32_t ikv, std::vector<uint8_t> & out) const { (void) mem; (void) ikv; (void) out; }
    virtual void state_read (llama_kvp_memory & mem, int32_t ikv, const std::vector<uint8_t> & in) const { (void) mem; (void) ikv; (void) in; }
};

struct llama_kvp_prefill_stage : llama_kvp_stage {
    using llama_kvp_stage::llama_kvp_stage;

    // prompt tokens per ubatch (the headroom of each layer's cache)
    virtual uint32_t chunk(const llama_kvp_policy & p, uint32_t n_ubatch) const;

    // tokens of the prompt's end run behind each chunk and removed after it (0: none)
    virtual uint32_t n_guide(const llama_kvp_policy & p, uint32_t n_ubatch) const { (void) p; (void) n_ubatch; return 0; }

    // each layer's cache holds a whole number of this many cells (a power of two; 1: any number)
    virtual uint32_t cell_align(const llama_kvp_policy & p) const { (void) p; return 1; }

    // does it compute the attention of prompt ubatches itself (then the context has a policy state even without
    // observation or retention, and the hooks below run)
    virtual bool computes_attention() const { return false; }

    // makes its state of KV layer ikv (of the current sequence) for a context of n_ctx_seq tokens per sequence
    // (llama_kvp_obs_layer::prefill_state; throws std::runtime_error on failure)
    virtual void alloc(llama_kvp_context * st, int32_t ikv, int32_t n_ctx_seq) const { (void) st; (void) ikv; (void) n_ctx_seq; }

    // what a saved state holds of that state of KV layer ikv (nothing by default), and its restoration (throws
    // std::runtime_error where it does not fit)
    virtual void state_write(const llama_kvp_context * st, int32_t ikv, std::vector<uint8_t> & out) const { (void) st; (void) ikv; (void) out; }
    virtual void state_read (llama_kvp_context * st, int32_t ikv, const std::vector<uint8_t> & in) const { (void) st; (void) ikv; (void) in; }

    // graph nodes it adds per layer to the graph of a ubatch of n_ubatch tokens
    virtual uint32_t n_graph_nodes(const llama_kvp_policy & p, uint32_t n_ubatch) const { (void) p; (void) n_ubatch; return 0; }

    // a graph of the context st is built next on this thread
    virtual void graph_begin(llama_kvp_context * st) const { (void) st; }

    // the attention of model layer il in that graph, as [n_embd_head_v*n_head, n_tokens], or nullptr for llama.cpp's
    //   q: [n_embd_head, n_head, n_tokens], k, v: [n_embd_head, n_head_kv, n_kv, 1] views of the layer's cache
    virtual ggml_tensor * graph_attn(llama_kvp_context * st, const llm_graph_context & gctx, ggml_tensor * q, ggml_tensor * k,
                                     ggml_tensor * v, ggml_tensor * kq_mask, ggml_tensor * sinks, float kq_scale, int il) const {
        (void) st; (void) gctx; (void) q; (void) k; (void) v; (void) kq_mask; (void) sinks; (void) kq_scale; (void) il;
        return nullptr;
    }
};

//
// registry (llama-kvp-stages.cpp)
//

// every stage, in the order of the listing
const std::vector<const llama_kvp_stage *> & llama_kvp_stage_all();

// the stage with this id or name (nullptr if none)
const llama_kvp_stage * llama_kvp_stage_by_id(int32_t id);
const llama_kvp_stage * llama_kvp_stage_by_name(const std::string & name);

const char * llama_kvp_slot_name(int32_t slot);

// the stage of a policy in one slot (nullptr: empty slot)
const llama_kvp_budget_stage   * llama_kvp_budget_of  (const llama_kvp_policy & p);
const llama_kvp_score_stage    * llama_kvp_score_of   (const llama_kvp_policy & p);
const llama_kvp_schedule_stage * llama_kvp_schedule_of(const llama_kvp_policy & p);
const llama_kvp_fate_stage     * llama_kvp_fate_of    (const llama_kvp_policy & p);
const llama_kvp_prefill_stage  * llama_kvp_prefill_of (const llama_kvp_policy & p);

//
// the stage implementations (one file each in stages/)
//

const llama_kvp_stage * llama_kvp_stage_budget_uniform();
const llama_kvp_stage * llama_kvp_stage_budget_pyramid();
const llama_kvp_stage * llama_kvp_stage_budget_entropy();
const llama_kvp_stage * llama_kvp_stage_score_recency();
const llama_kvp_stage * llama_kvp_stage_score_window();
const llama_kvp_stage * llama_kvp_stage_score_accumulated();
const llama_kvp_stage * llama_kvp_stage_schedule_prompt();
const llama_kvp_stage * llama_kvp_stage_schedule_every();
const llama_kvp_stage * llama_kvp_stage_schedule_freeze();
const llama_kvp_stage * llama_kvp_stage_schedule_latent();
const llama_kvp_stage * llama_kvp_stage_fate_drop();
const llama_kvp_stage * llama_kvp_stage_fate_summarise();
const llama_kvp_stage * llama_kvp_stage_fate_host();
const llama_kvp_stage * llama_kvp_stage_prefill_dense();
const llama_kvp_stage * llama_kvp_stage_prefill_sparse();

// shared checks of key values ("" if fine), used by the stages that read those keys
std::string llama_kvp_check_budget  (const llama_kvp_policy & p);
std::string llama_kvp_check_protect (const llama_kvp_policy & p, int32_t min_recent);
std::string llama_kvp_check_window  (const llama_kvp_policy & p);
std::string llama_kvp_check_decay   (const llama_kvp_policy & p);
std::string llama_kvp_check_chunk   (const llama_kvp_policy & p); // chunk and guide (prefill stages)

// a key that is a share of the layers (split_share, span_share, fill_share): its check, in (0, 1], and the number of
// layers it covers, rounded, at least one
std::string llama_kvp_check_layer_share(const char * key, float share);
int32_t     llama_kvp_layer_share_count(float share, int32_t n_layer);

// tokens of the prompt's end run behind each chunk with guide=1 (prefill stages)
uint32_t llama_kvp_prefill_n_guide(const llama_kvp_policy & p, uint32_t n_ubatch);

// the keys of a score stage that observes: window, decay, n_sink, n_recent, topk_share
std::string llama_kvp_check_observed_score(const llama_kvp_policy & p);

// the protected tokens that fit when a layer keeps n_keep: the recent ones first (at least the newest), then sinks
void llama_kvp_clamp_protected(uint32_t n_keep, uint32_t & n_sink, uint32_t & n_recent);

// the middle cells[i0, i1) in the order a layer keeps them: the n_topk best by score first (ties: the newer token),
// then the others in position order (those leave)
std::vector<uint32_t> llama_kvp_rank_middle(const std::vector<llama_kvp_cell> & cells, uint32_t i0, uint32_t i1, uint32_t n_topk);

//
// the host tier (stages/fate-host.cpp), also used by the freeze schedule
//

// moves the tokens of `cells` (cells of KV layer ikv) into its host tier, each with its timer (0: cold, it stays until
// thawed by name; > 0: it thaws after that many decode steps); their cells are freed. Reads are batched per call.
void llama_kvp_host_freeze(llama_kvp_memory & mem, int32_t ikv, const std::vector<llama_kvp_cell> & cells, const std::vector<int32_t> & timers);

// one decode step passes for the frozen tokens of KV layer ikv: timers go down by one; tokens at 0 thaw into free
// cells, at most n_room of them (the others wait a step); returns the tokens thawed
uint32_t llama_kvp_host_tick(llama_kvp_memory & mem, int32_t ikv, uint32_t n_room);

// the tokens of KV layer ikv's host tier: positions and keys as f32 rows of n_embd_k (nothing if it has none)
void llama_kvp_host_keys(llama_kvp_memory & mem, int32_t ikv, std::vector<llama_pos> & pos, std::vector<float> & k);

// thaws the host tokens of KV layer ikv at positions `pos` (at most n_room) with these scores; returns the count
uint32_t llama_kvp_host_thaw_pos(llama_kvp_memory & mem, int32_t ikv, const std::vector<llama_pos> & pos,
                                 const std::vector<float> & score, uint32_t n_room);

// thaws the frozen tokens of KV layer ikv (timer > 0) whose timer is at least min_timer and that were frozen at
// decode step since_step or later, at most n_room; returns the count
uint32_t llama_kvp_host_thaw_frozen(llama_kvp_memory & mem, int32_t ikv, int32_t min_timer, int32_t since_step, uint32_t n_room);

// the recovery ladder of the `freeze` schedule (stages/schedule-freeze.cpp): one generated token's logits; returns
// the level acted on (0: none); and its counters per level (n_level[4]) and events
int32_t llama_kvp_freeze_recover(llama_kvp_memory & mem, const float * logits, int32_t n_vocab);
void    llama_kvp_freeze_ladder (llama_kvp_memory & mem, int32_t * n_level, std::vector<int32_t> * step,
                                 std::vector<int32_t> * level, std::vector<float> * entropy);

// re-ranks the active and host tokens of every layer now (schedule stage `latent`, stages/schedule-latent.cpp);
// whether a token moved between the tiers
bool llama_kvp_latent_rerank_layers(llama_kvp_memory & mem);

// whether the policy re-ranks (schedule `latent`, or `freeze` with gap >= 0), and whether at each prompt's end (gap=0)
bool llama_kvp_latent_reranks      (const llama_kvp_policy & p);
bool llama_kvp_latent_at_prompt_end(const llama_kvp_policy & p);

// the end of a prompt tokens[0..n) at positions pos0.. of the memory's current sequence, just evaluated, under a policy
// that re-ranks there: re-rank, evaluate its last `window` tokens again (only its last one unless `pruned`: they were
// computed on a pruned cache), re-rank and evaluate its last token again; with `logits`, the rows of the tokens
// evaluated again ([n][n_vocab]). Returns the most tokens evaluated again (0: none, for another policy), -1 on error
int32_t llama_kvp_latent_rerun_end(llama_context * ctx, llama_kvp_memory & mem, const llama_token * tokens, int32_t n,
                                   llama_pos pos0, bool pruned, float * logits);

// before a single-token decode step: re-ranks every layer if the policy's `gap` makes this step due (the `latent`
// schedule, and `freeze` with gap >= 0)
void llama_kvp_latent_before_step(llama_kvp_memory & mem);

// thaws every token of KV layer ikv's host tier that fits into n_room free cells, coldest last; returns the count
uint32_t llama_kvp_host_tier_thaw(llama_kvp_memory & mem, int32_t ikv, uint32_t n_room);

// the C API's check of a context with a host tier: its per-layer memory, or nullptr with the error set
llama_kvp_memory * llama_kvp_host_mem(struct llama_context * ctx);
