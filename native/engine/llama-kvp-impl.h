// llama-kvp-impl.h - internal side of pykvcache inside libllama: the per-context policy state and the hooks called
// from the patched llama.cpp files (native/patches/). Keep the hooks null-safe: without a policy they do nothing.
#pragma once

#include "llama-kvp.h"

#include "llama.h"
#include "ggml.h"
#include "ggml-backend.h"
#include "ggml-cpp.h"

#include <memory>
#include <string>
#include <utility>
#include <vector>

struct llama_model;
struct llama_cparams;
struct llama_memory_i;
struct llm_graph_context;
struct llama_ubatch;
class  llama_kv_cache;
class  llama_kv_cache_context;
struct llama_memory_context_i;

//
// errors
//

// sets the thread-local message returned by llama_kvp_last_error()
void llama_kvp_set_error(const std::string & msg);

//
// policy parameters (llama-kvp-policy.cpp)
//

// returns "" if the policy is valid, else the reason
std::string llama_kvp_policy_check(const llama_kvp_policy & policy);

const char * llama_kvp_policy_type_name(int32_t type);

//
// per-context state
//

// device-resident observation results of one attention layer
struct llama_kvp_obs_layer {
    int32_t il = -1;                 // model layer index

    ggml_tensor * q_ring   = nullptr; // F32 [n_embd_head*n_head, window]  last post-RoPE queries, slot = pos % window
    ggml_tensor * mass     = nullptr; // F32 [n_cells, n_head]             mean attention of the window queries
    ggml_tensor * mass_acc = nullptr; // F32 [n_cells]                     decayed sum of the head-mean mass
    ggml_tensor * entropy  = nullptr; // F32 [n_head]                      mean entropy of the window queries (nats)

    bool seen = false;                // the graph hook ran for this layer (checked after the reserve)
};

struct llama_kvp_context {
    llama_kvp_policy policy;

    const llama_model & model;
    llama_kv_cache    * kv = nullptr; // the context's unified KV cache

    bool    causal_attn = true;
    int32_t n_head      = 0;
    int32_t n_head_kv   = 0;
    int32_t n_embd_head = 0;
    int32_t n_cells     = 0;

    std::vector<llama_kvp_obs_layer> layers;     // one per KV-cache layer
    std::vector<int32_t>             layer_of_il; // model layer -> index into layers (-1: no KV)

    std::vector<std::pair<ggml_context_ptr, ggml_backend_buffer_ptr>> ctxs_bufs;

    // host-side bookkeeping of the observation window and cells
    std::vector<llama_pos> slot_pos;     // position whose query sits in each ring slot (-1: none)
    std::vector<llama_pos> cell_pos_obs; // position held by each cell at the last observation (-2: unknown)

    int32_t n_steps       = 0; // ubatches processed
    int32_t n_decode      = 0; // single-token ubatches processed
    int32_t n_obs         = 0; // observations made
    int32_t n_kv_obs      = 0; // cells covered by the last observation
    int32_t n_queries_obs = 0; // valid window queries of the last observation
    bool    obs_requested = false;

    llama_kvp_context(const llama_model & model) : model(model) {}

    bool observing() const { return policy.type == LLAMA_KVP_POLICY_OBSERVE; }

    // does a graph for this ubatch (of a decode call split into n_ubatches) include the observation nodes?
    bool want_obs(const llama_ubatch & ubatch, size_t n_ubatches) const;
};

// read access to the private parts of llama_kv_cache (a friend of it, see patch 0003)
struct llama_kvp_kv_access {
    static int32_t n_layers(const llama_kv_cache & kv);
    static int32_t layer_il(const llama_kv_cache & kv, int32_t ikv);
    static ggml_tensor * layer_k(const llama_kv_cache & kv, int32_t ikv);
    static ggml_tensor * layer_v(const llama_kv_cache & kv, int32_t ikv);
    static uint32_t n_stream(const llama_kv_cache & kv);
    static uint32_t n_used(const llama_kv_cache & kv);
    static llama_pos cell_pos(const llama_kv_cache & kv, uint32_t i); // -1 for an empty cell

    // ubatches of the decode call a memory context belongs to
    static size_t n_ubatches(const llama_memory_context_i * mctx);
};

//
// hooks called from the patched llama.cpp sources
//

// llama_context constructor, after the memory is created: takes the pending policy of this thread (if any),
// validates it against the model and context and allocates its state; throws std::runtime_error on failure
std::unique_ptr<llama_kvp_context> llama_kvp_context_init(
        const llama_model   & model,
        const llama_cparams & cparams,
        llama_memory_i      * memory);

// llama_context constructor, after the worst-case graphs are reserved: throws if some attention layer was not seen
void llama_kvp_context_check(llama_kvp_context * kvp);

// extra graph nodes the policy adds (added to llama_context::graph_max_nodes)
uint32_t llama_kvp_graph_n_nodes(const llama_kvp_context * kvp);

// llama_context::graph_params: the graph built next on this thread belongs to this context
void llama_kvp_graph_begin(llama_kvp_context * kvp);

// llm_graph_context::build_attn (unified KV cache), after the attention of layer il
//   q: [n_embd_head, n_head, n_tokens] post-RoPE queries, k: [n_embd_head, n_head_kv, n_kv, 1] view of the K cache
void llama_kvp_graph_observe(
        const llm_graph_context & gctx,
                    ggml_tensor * q,
                    ggml_tensor * k,
                    ggml_tensor * sinks,
                          float   kq_scale,
                            int   il);
