// llama-kvp-impl.h - internal side of pykvcache inside libllama: the per-context policy state and the hooks called
// from the patched llama.cpp files (native/patches/). Keep the hooks null-safe: without a policy they do nothing.
#pragma once

#include "llama-kvp.h"
#include "llama-kvp-stage.h"

#include "llama.h"
#include "ggml.h"
#include "ggml-backend.h"
#include "ggml-cpp.h"

#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

struct llama_model;
struct llama_cparams;
struct llama_memory_i;
struct llama_io_write_i;
struct llama_io_read_i;
struct llm_graph_context;
struct llama_ubatch;
class  llama_kv_cache;
class  llama_kv_cache_context;
struct llama_memory_context_i;
struct llama_memory_params;
struct llama_context;

//
// errors
//

// sets the thread-local message returned by llama_kvp_last_error()
void llama_kvp_set_error(const std::string & msg);

//
// policy parameters (llama-kvp-policy.cpp)
//

// a budget that stands for the whole context (the `freeze` preset keeps every token; it is checked against no n_ctx)
static constexpr float LLAMA_KVP_BUDGET_ALL = 16777216.0f; // 2^24: above any budget a float holds exactly

// returns "" if the policy is valid, else the reason
std::string llama_kvp_policy_check(const llama_kvp_policy & policy);

// the canonical spec string
std::string llama_kvp_policy_str(const llama_kvp_policy & policy);

// the name of a preset
const char * llama_kvp_policy_type_name(int32_t type);

// has a budget stage: one KV cache per layer, sized to a budget
bool llama_kvp_policy_retains(const llama_kvp_policy & policy);

// has a score stage that needs the in-graph observation of attention
bool llama_kvp_policy_observes(const llama_kvp_policy & policy);

// does the policy's prefill stage compute the attention of prompt ubatches itself (block-sparse: `sparse`)
bool llama_kvp_policy_sparse(const llama_kvp_policy & policy);

// tokens the score stage always keeps (sinks + recent window)
int32_t llama_kvp_policy_n_protected(const llama_kvp_policy & policy);

// the pending policy of this thread, without consuming it; false if none
bool llama_kvp_pending_peek(llama_kvp_policy & out);

//
// per-context state
//

// device-resident observation results of one attention layer
struct llama_kvp_obs_layer {
    int32_t il = -1;                 // model layer index
    int32_t n_cells = 0;             // cells of the layer's cache (rows of mass, mass_acc)
    int32_t n_kv_obs = 0;            // cells covered by the last observation

    ggml_context_ptr        ctx;     // one buffer per layer: a per-layer cache can be reallocated alone
    ggml_backend_buffer_ptr buf;

    ggml_tensor * q_ring   = nullptr; // F32 [n_embd_head*n_head, window]  last post-RoPE queries, slot = pos % window
    ggml_tensor * mass     = nullptr; // F32 [n_cells, n_head]             mean attention of the window queries
    ggml_tensor * mass_acc = nullptr; // F32 [n_cells, 3]                  decayed sum of the head-mean mass; the last
                                      //                                   observation's head-mean mass (row 1); with
                                      //                                   vnorm, the value norm of each cell's token
                                      //                                   (row 2, NaN where the host changed the cell)
    ggml_tensor * entropy  = nullptr; // F32 [n_head]                      mean entropy of the window queries (nats)

    std::vector<llama_pos> cell_pos_obs; // position held by each cell at the last observation (-2: unknown)

    // decode-step rows (a retention policy whose window is longer than one query): each step's head-mean attention
    // probabilities, kept per ring slot, so that an observing decode step sums rows instead of computing K·Q again
    ggml_tensor * mass_rows = nullptr;   // F32 [n_cells, window]  row of ring slot s: its query's head-mean probabilities
    std::vector<int32_t>   row_step;     // step that wrote each row (-1: none)
    std::vector<int32_t>   cell_step;    // step from which each cell holds its token
    std::vector<llama_pos> cell_pos_row; // position held by each cell when cell_step was set (-2: unknown)
    std::vector<float>     q_ent;        // llama_kvp_obs_layer_query_entropy at observation q_ent_obs (-1: none), and
    std::vector<llama_pos> q_ent_pos;    // the position each value is of
    int32_t                q_ent_obs = -1;

    // host copies of mass_acc's score rows and of mass_rows, read for every evicting layer at once by
    // llama_kvp_obs_prefetch (empty: read when needed); valid for one eviction pass
    std::vector<float> pre_acc;
    std::vector<float> pre_rows;

    // the prefill stage's own state of this layer (llama_kvp_prefill_stage::alloc; nullptr: none)
    std::unique_ptr<llama_kvp_layer_state> prefill_state;

    bool  seen     = false;           // the graph hook ran for this layer (checked after the reserve)
    float kq_scale = 0.0f;            // the attention's scale of the queries' dot products (set by the graph hook)
};

class llama_kvp_memory;

// the per-sequence observation state, for a sequence that is not the current one (see llama_kvp_memory::seq_use)
struct llama_kvp_obs_seq {
    std::vector<llama_kvp_obs_layer> layers;
    std::vector<llama_pos>           slot_pos;
    std::vector<double>              ent_sum;

    int32_t n_cells       = 0;
    int32_t n_ent         = 0;
    int32_t n_obs_prompt  = 0;
    int32_t n_obs_folded  = 0;
    int32_t n_decode      = 0;
    int32_t n_obs         = 0;
    int32_t n_kv_obs      = 0;
    int32_t n_queries_obs = 0;
    int32_t n_obs_heads   = 0;
    int32_t n_obs_ent     = 0;
    llama_pos pos_obs     = -1;
    llama_pos pos_ent     = -1;
};

struct llama_kvp_context;

// many small reads of tensors in device memory as one transfer (llama-kvp-gather.cpp): pieces are added, then run()
// fills the output of every piece; a piece in host memory is read at once, in place
struct llama_kvp_gather {
    struct piece {
        ggml_tensor         * t     = nullptr;
        bool                  trans = false; // a transposed V cache
        uint32_t              size  = 0;     // the cache's cells
        std::vector<uint32_t> idx;           // cells read (rows), or none: the f32 range [off, off + n)
        size_t                off   = 0;
        size_t                n     = 0;     // floats written to out
        float               * out   = nullptr;
    };

    // cells idx of the cache tensor t (trans: a transposed V of `size` cells) as f32 rows [idx.size()][t->ne[0]] into out
    void add_rows(ggml_tensor * t, bool trans, uint32_t size, const std::vector<uint32_t> & idx, float * out);

    // elements [off, off + n) of the f32 tensor t into out
    void add_f32(ggml_tensor * t, size_t off, size_t n, float * out);

    // reads the pieces added since the last run: per device one graph copying them into one staging tensor, one read
    void run(llama_kvp_context * st);

    std::vector<piece> pieces;
};

// a backend and graph allocator per device that gathers ran on (llama-kvp-gather.cpp)
struct llama_kvp_gather_state;
struct llama_kvp_gather_state_deleter {
    void operator()(llama_kvp_gather_state * s) const;
};

struct llama_kvp_context;

// adds the wall time of its scope to one of the policy's llama_kvp_perf_data totals (none: st null), less the time
// llama_kvp_sync waited in it for the backends, which goes to t_wait_ms (an outer scope counts it once)
struct llama_kvp_perf_scope {
    llama_kvp_perf_scope(llama_kvp_context * st, double llama_kvp_perf_data::* part);
    ~llama_kvp_perf_scope();

    llama_kvp_context * const st;
    double llama_kvp_perf_data::* const part;
    const int64_t t0;
    int64_t       wait0 = 0;
};

struct llama_kvp_context {
    llama_kvp_policy policy;

    const llama_model & model;
    llama_context     * lctx = nullptr;
    llama_kv_cache    * kv   = nullptr; // the context's unified KV cache (observe policy)
    llama_kvp_memory  * mem  = nullptr; // the per-layer KV memory (retention policies)

    bool    causal_attn = true;
    int32_t n_head      = 0;
    int32_t n_head_kv   = 0;
    int32_t n_embd_head = 0;
    int32_t n_cells     = 0; // largest layer capacity

    std::vector<llama_kvp_obs_layer> layers;     // one per KV-cache layer
    std::vector<int32_t>             layer_of_il; // model layer -> index into layers (-1: no KV)

    // host-side bookkeeping of the observation window
    std::vector<llama_pos> slot_pos;     // position whose query sits in each ring slot (-1: none)

    // entropy of the prompt observations, summed per layer (entropy policy budgets)
    std::vector<double> ent_sum;
    int32_t n_ent         = 0;
    int32_t n_obs_prompt  = 0; // observations made by prompt ubatches
    int32_t n_obs_folded  = 0; // of those, folded into ent_sum

    int32_t n_steps       = 0; // ubatches processed
    int32_t n_decode      = 0; // single-token ubatches processed since the cache was last emptied or restarted
    int32_t n_obs         = 0; // observations made
    int32_t n_kv_obs      = 0; // cells covered by the last observation
    int32_t n_queries_obs = 0; // valid window queries of the last observation
    // the decode observations of a policy with decode rows keep the head mean of the mass only (no per-head mass, no
    // entropy): the last observation that wrote the per-head mass in every layer, the last that computed the entropy,
    // and the last query position of the last observation and of that entropy's
    int32_t   n_obs_heads = 0;
    int32_t   n_obs_ent   = 0;
    llama_pos pos_obs     = -1;
    llama_pos pos_ent     = -1;
    size_t  n_steps_call  = 1; // ubatches of the decode call the current graph belongs to
    bool    obs_requested = false;
    bool    sparse_warned = false; // the reason prefill stays dense was logged
    llama_pos prompt_end  = -1;    // the prompt's last position where the caller said it (llama_kvp_set_prompt_end)
    uint32_t n_ubatch     = 512;   // tokens per ubatch at most

    std::vector<llama_kvp_obs_seq> seqs; // by sequence id: the parked state of every sequence but the memory's current one

    std::unique_ptr<llama_kvp_gather_state, llama_kvp_gather_state_deleter> gather; // made by the first gather off the host

    llama_kvp_perf_data perf = {}; // the policy's host time (llama_kvp_perf)
    int64_t t_sync_us  = 0;        // llama_kvp_sync's waits so far, timed or not
    int32_t perf_depth = 0;        // perf scopes open now

    llama_kvp_context(const llama_model & model) : model(model) {}

    // the policy computes observations (its score stage observes)
    bool observing() const { return obs_on; }
    bool obs_on = false;

    // the KV cache holding layer ikv
    llama_kv_cache * layer_kv(int32_t ikv) const;

    // decode steps keep their attention rows (see llama_kvp_obs_layer::mass_rows): a retention policy (per-layer
    // memory) observing a window of several queries
    bool rows_mode() const { return obs_on && mem && policy.window > 1; }

    // does a graph for this ubatch (of a decode call split into n_ubatches) include the observation nodes?
    bool want_obs(const llama_ubatch & ubatch, size_t n_ubatches) const;

    // does that observation (obs: want_obs of the same ubatch) also compute the attention entropy
    bool want_entropy(bool obs, const llama_ubatch & ubatch, size_t n_ubatches) const;
};

// read access to the private parts of llama_kv_cache (a friend of it, see patch 0003)
struct llama_kvp_kv_access {
    static int32_t n_layers(const llama_kv_cache & kv);
    static int32_t layer_il(const llama_kv_cache & kv, int32_t ikv);
    static ggml_tensor * layer_k(const llama_kv_cache & kv, int32_t ikv);
    static ggml_tensor * layer_v(const llama_kv_cache & kv, int32_t ikv);
    static uint32_t n_stream(const llama_kv_cache & kv);
    static bool     v_trans (const llama_kv_cache & kv); // V stored a row per dimension (made without flash attention)
    static uint32_t n_used(const llama_kv_cache & kv);
    static llama_pos cell_pos(const llama_kv_cache & kv, uint32_t i); // -1 for an empty cell
    static void cell_positions(const llama_kv_cache & kv, uint32_t n, llama_pos * out); // cell_pos of cells [0, n)
    static void cell_positions_of_seq(const llama_kv_cache & kv, uint32_t n, llama_seq_id seq, llama_pos * out); // -1 where not of seq
    static void cell_rm(llama_kv_cache & kv, uint32_t i);
    static void cell_set(llama_kv_cache & kv, uint32_t i, llama_pos pos, llama_seq_id seq); // an empty cell now holds pos of seq
    static uint32_t head(const llama_kv_cache & kv);         // where find_slot looks for a free cell first
    static void     head_set(llama_kv_cache & kv, uint32_t h);
    // the Walsh-Hadamard matrix [n*n] by which llama.cpp rotates the rows of a quantized cache's K (and the queries)
    // or V in chunks of n (llama_kv_cache::build_input_k_rot, build_input_v_rot); nullptr where it does not rotate
    static const float * rot(const llama_kv_cache & kv, bool v, int32_t & n);

    // ubatches of the decode call a memory context belongs to
    static size_t n_ubatches(const llama_memory_context_i * mctx);
};

//
// hooks called from the patched llama.cpp sources
//

// llama_context constructor, after the memory is created: takes the pending policy of this thread (if any),
// validates it against the model and context and allocates its state; throws std::runtime_error on failure
std::unique_ptr<llama_kvp_context> llama_kvp_context_init(
        llama_context       * lctx,
        const llama_model   & model,
        const llama_cparams & cparams,
        llama_memory_i      * memory);

// llama_context constructor, instead of llama_model::create_memory: the per-layer memory when the pending policy
// is a retention policy (throws std::runtime_error naming the architecture if the model cannot have one)
llama_memory_i * llama_kvp_create_memory(
        const llama_model         & model,
        const llama_memory_params & params,
        const llama_cparams       & cparams);

// llama_context constructor, after the worst-case graphs are reserved: throws if some attention layer was not seen
void llama_kvp_context_check(llama_kvp_context * kvp);

// llama_context's state, after llama.cpp's own cache (memory): the prefill stage's state where it keeps one
// (sparse prefill without a retention policy; the per-layer memory saves it itself); nothing otherwise, so that a
// context without it keeps llama.cpp's format. The read throws std::runtime_error where the state does not fit
void llama_kvp_context_state_write(const llama_kvp_context * kvp, const llama_memory_i * memory, llama_io_write_i & io);
void llama_kvp_context_state_read (llama_kvp_context * kvp, const llama_memory_i * memory, llama_io_read_i & io);

// extra graph nodes the policy adds (added to llama_context::graph_max_nodes)
uint32_t llama_kvp_graph_n_nodes(const llama_kvp_context * kvp);

// llama_context::graph_params: the graph built next on this thread belongs to this context
void llama_kvp_graph_begin(llama_kvp_context * kvp);

// the context of the graph being built on this thread (nullptr: none, or one without a policy)
llama_kvp_context * llama_kvp_graph_ctx();

// llm_graph_context::build_attn_inp_kv: the per-layer attention input when the memory is per-layer, else nullptr
class llm_graph_input_attn_kv;
llm_graph_input_attn_kv * llama_kvp_build_attn_inp_kv(const llm_graph_context & gctx);

// a graph input of n_bytes that the layers' inputs of one kind are views of (the scheduler uploads each input of an
// offloaded split on its own, after a synchronisation); *src is what the views are cut from: the input itself, or with
// device_copy its copy by a ggml_cont, which the scheduler runs on the device (a view of a host input stays on the host)
ggml_tensor * llama_kvp_packed_input(ggml_context * ctx, ggml_type type, size_t n_bytes, const char * name,
                                     bool device_copy, ggml_tensor ** src);

// llm_graph_context::build_attn: the input of layer il (itself unless it is a per-layer input)
llm_graph_input_attn_kv * llama_kvp_attn_inp_layer(llm_graph_input_attn_kv * inp, int il);

// llm_graph_context::build_attn (unified KV cache), after the attention of layer il
//   q: [n_embd_head, n_head, n_tokens] post-RoPE queries, k: [n_embd_head, n_head_kv, n_kv, 1] view of the K cache
void llama_kvp_graph_observe(
        const llm_graph_context & gctx,
                    ggml_tensor * q,
                    ggml_tensor * k,
                    ggml_tensor * sinks,
                          float   kq_scale,
                            int   il);

// llm_graph_context::build_attn, instead of build_attn_mha: the attention of layer il computed by pykvcache, as
// [n_embd_head_v*n_head, n_tokens], or nullptr for build_attn_mha (llama-kvp-graph.cpp)
//   q: [n_embd_head, n_head, n_tokens], k, v: [n_embd_head, n_head_kv, n_kv, 1] views of the layer's cache
ggml_tensor * llama_kvp_graph_attn(
        const llm_graph_context & gctx,
                    ggml_tensor * q,
                    ggml_tensor * k,
                    ggml_tensor * v,
                    ggml_tensor * kq_mask,
                    ggml_tensor * sinks,
                          float   kq_scale,
                            int   il);

// the attention of an observed single-token step (window 1) computed so that it keeps its probabilities, which the
// step's observation then takes instead of computing K·Q again: GGML_OP_SPARSE_ATTN_EXT's probabilities mode with
// flash attention's layout (CPU), K·Q, softmax and P·V with V transposed (any backend); else nullptr
ggml_tensor * llama_kvp_graph_observed_attn(
        const llm_graph_context & gctx,
                    ggml_tensor * q,
                    ggml_tensor * k,
                    ggml_tensor * v,
                    ggml_tensor * kq_mask,
                    ggml_tensor * sinks,
                          float   kq_scale,
                            int   il);

//
// a stage's device state beside a layer's cache (llama-kvp-observe.cpp)
//

// a no-alloc ggml context for n_tensors tensor headers, and a buffer for its tensors in the buffer type of KV layer
// ikv's K cache (zeroed); both throw std::runtime_error naming `what` on failure (llama-kvp-observe.cpp)
ggml_context *        llama_kvp_layer_ctx  (int32_t n_tensors, const char * what);
ggml_backend_buffer_t llama_kvp_layer_alloc(llama_kvp_context * st, int32_t ikv, ggml_context * ctx, const char * what);

//
// the C API's checks (llama-kvp.cpp), also used by the stages' own C API in their files: false or nullptr, with the
// error set (llama_kvp_last_error), when the check fails
//

bool llama_kvp_check_ctx(llama_context * ctx);                        // a context, not NULL
bool llama_kvp_check_out(const void * out);                           // an output, not NULL
llama_kvp_memory * llama_kvp_mem(llama_context * ctx);                // the per-layer memory of a retention policy
bool llama_kvp_check_layer(const llama_kvp_memory * mem, int32_t ikv); // a KV layer of that memory

// that memory, where the policy's fate stage is `fate` (else the error `err`)
llama_kvp_memory * llama_kvp_mem_with_fate(llama_context * ctx, int32_t fate, const char * err);

//
// observation results used by the per-layer memory (llama-kvp-observe.cpp)
//

// runs fn(task, thread) for tasks [0, n_tasks) on up to n_threads threads, this one among them (the context's compute
// threads are idle while the memory works between two graphs); each task runs once, on one thread
void llama_kvp_run_tasks(int32_t n_tasks, int32_t n_threads, const std::function<void(int32_t, int32_t)> & fn);

// waits for the context's graph computations (before reading or writing its buffers from the host)
void llama_kvp_sync(llama_kvp_context * st);

// reads in one gather what the eviction of layers ikvs reads of their observations: the first n_rows rows of the
// scores (llama_kvp_obs_layer_scores) and, with rows, the decode rows (llama_kvp_obs_layer_query_entropy); only where
// they are off the host (one transfer instead of one or two per layer). llama_kvp_obs_prefetch_clear ends the pass
void llama_kvp_obs_prefetch(llama_kvp_context * st, const std::vector<int32_t> & ikvs, int32_t n_rows, bool rows);
void llama_kvp_obs_prefetch_clear(llama_kvp_context * st);

// folds new prompt observations into the per-layer mean entropy; true if there was one (out: mean per layer)
bool llama_kvp_obs_take_prompt_entropy(llama_kvp_context * st, float * out);

// accumulated mass and the position each cell held when it was observed, of KV layer ikv, with `last` the mass of
// the last observation alone and with `value` the value norms (NaN: not known on the device), in one read (synchronizes)
void llama_kvp_obs_layer_scores(llama_kvp_context * st, int32_t ikv, std::vector<float> & acc, std::vector<llama_pos> & obs_pos,
                                std::vector<float> * last = nullptr, std::vector<float> * value = nullptr);

// head-mean attention mass of the cells of KV layer ikv at the last observation (averaged over its valid window
// queries) and the position each cell held then (synchronizes); returns the cells covered
int32_t llama_kvp_obs_layer_mass(llama_kvp_context * st, int32_t ikv, std::vector<float> & mass, std::vector<llama_pos> & obs_pos);

// per cell of KV layer ikv (in a layer with decode-step rows, window > 1), now: the entropy of its token's head-mean
// attention over the window's queries that saw it (the rows written while the cell held the token, of queries at or
// after its position), divided by the log of their number, in [0, 1] (-1 where fewer than two queries saw it), and
// the position of that token (pos; -1: none); synchronizes; returns the cells covered
int32_t llama_kvp_obs_layer_query_entropy(llama_kvp_context * st, int32_t ikv, std::vector<float> & ent, std::vector<llama_pos> & pos);

// the same, computed once per observation (the first call after it; the decode steps until the next observation
// reuse it, as they reuse the scores)
int32_t llama_kvp_obs_layer_query_entropy_at_obs(llama_kvp_context * st, int32_t ikv, const std::vector<float> ** ent,
                                                 const std::vector<llama_pos> ** pos);

// computes the same for layers ikvs at once, the layers shared out among n_threads threads (an eviction pass that
// reorders the leavers by entropy, where every layer's values are needed)
void llama_kvp_obs_query_entropy_layers(llama_kvp_context * st, const std::vector<int32_t> & ikvs, int32_t n_threads);

// the observation state of the current sequence, for a saved state (llama_kvp_memory::state_write): the counters, the
// prompt entropies and the window queries' positions (obs_state_*), and per KV layer its device tensors (the window's
// queries, masses, scores, entropies, decode rows) and their bookkeeping by cell (obs_layer_state_*). A layer's cells
// must hold what they held when it was written; reading throws std::runtime_error on a state of other sizes.
void llama_kvp_obs_state_write      (const llama_kvp_context * st, std::vector<uint8_t> & out);
void llama_kvp_obs_state_read       (llama_kvp_context * st, const std::vector<uint8_t> & in, size_t & off);
void llama_kvp_obs_layer_state_write(llama_kvp_context * st, int32_t ikv, std::vector<uint8_t> & out);
void llama_kvp_obs_layer_state_read (llama_kvp_context * st, int32_t ikv, const std::vector<uint8_t> & in, size_t & off);

// KV layer ikv was reallocated with n_cells cells; remap[new cell] = old cell or -1
void llama_kvp_obs_layer_resize(llama_kvp_context * st, int32_t ikv, uint32_t n_cells, const std::vector<int32_t> & remap);

// forget scores and prompt entropies and restart the decode schedule (the cache was cleared or a prompt restarts)
void llama_kvp_obs_reset(llama_kvp_context * st);

// the valid post-RoPE queries of the observation window of KV layer ikv (synchronizes): q [n][n_head*n_embd_head],
// head-major within a row, and their positions in qpos when not null; returns n (0 without an observation ring)
int32_t llama_kvp_obs_layer_queries(llama_kvp_context * st, int32_t ikv, std::vector<float> & q, std::vector<llama_pos> * qpos = nullptr);

// cells idx[0..n) of KV layer ikv now hold pos[] with these accumulated scores (cells filled by a fate stage), in one
// read and one write of the span they cover, with their last observations (null: the scores) and their value norms
// (null: not known, the host computes them when a policy uses them)
void llama_kvp_obs_cells_set_score(llama_kvp_context * st, int32_t ikv, const uint32_t * idx, const llama_pos * pos,
                                   const float * score, size_t n, const float * last = nullptr,
                                   const float * value = nullptr);

// exchanges the current sequence's observation state with o's (llama_kvp_memory::seq_use)
void llama_kvp_obs_seq_swap(llama_kvp_context * st, llama_kvp_obs_seq & o);

// whether token i of the ubatch counts as one whose logits are read (none in a guided chunk): the prompt's last where
// the caller said which it is (llama_kvp_set_prompt_end), else a token that gives logits (summarise's settle, sparse
// prefill's dense segments)
bool llama_kvp_reads_logits(const llama_kvp_context * st, const llama_ubatch & ubatch, uint32_t i);

// forget the scores of the cells of KV layer ikv that hold positions [p0, p1) (p < 0: unbounded), before a seq_rm
void llama_kvp_obs_layer_forget(llama_kvp_context * st, int32_t ikv, llama_pos p0, llama_pos p1);
