// llama-kvp.h - native API of pykvcache: KV-cache policies and telemetry inside llama.cpp
//
// The policy of a context is chosen without touching llama_context_params: set a pending policy on the calling
// thread, then create the context with llama_init_from_model() on the same thread; the context consumes it.
//
//     struct llama_kvp_policy pol = llama_kvp_policy_default(LLAMA_KVP_POLICY_OBSERVE);
//     pol.window = 64;
//     if (llama_kvp_set_pending(&pol) != 0) { puts(llama_kvp_last_error()); }
//     struct llama_context * ctx = llama_init_from_model(model, cparams);
//     if (!ctx) { puts(llama_kvp_last_error()); }   // e.g. an architecture the policy cannot handle
//
// Every function returns 0 (or a count >= 0) on success and a negative value on failure; the reason is then in
// llama_kvp_last_error() (thread-local). Arrays are written into caller-owned buffers of the stated sizes.

#pragma once

#include <stddef.h>
#include <stdint.h>

#ifdef LLAMA_SHARED
#    if defined(_WIN32) && !defined(__MINGW32__)
#        ifdef LLAMA_BUILD
#            define LLAMA_KVP_API __declspec(dllexport)
#        else
#            define LLAMA_KVP_API __declspec(dllimport)
#        endif
#    else
#        define LLAMA_KVP_API __attribute__ ((visibility ("default")))
#    endif
#else
#    define LLAMA_KVP_API
#endif

#define LLAMA_KVP_API_VERSION 1

#ifdef __cplusplus
extern "C" {
#endif

// cffi-begin (the lines up to cffi-end are read by bindings/llama_kvp_ffi.py; plain C declarations only)

struct llama_context;

enum llama_kvp_policy_type {
    LLAMA_KVP_POLICY_NONE    = 0, // full cache, no observation
    LLAMA_KVP_POLICY_OBSERVE = 1, // full cache + in-graph attention observation (telemetry)
};

struct llama_kvp_policy {
    int32_t type;   // enum llama_kvp_policy_type
    int32_t window; // observation window: the last `window` queries of the sequence (>= 1)
    int32_t every;  // also observe every `every` single-token decode steps (0 = prompt batches only)
    float   decay;  // accumulated mass: acc = decay*acc + mass at each observation, in [0, 1]
};

// per layer of the KV cache, as allocated in the real ggml buffers
struct llama_kvp_layer_stats {
    int32_t il;         // model layer index
    int32_t n_cells;    // capacity (cells)
    int32_t n_used;     // cells holding a token
    int64_t k_bytes;    // bytes of the K tensor of this layer
    int64_t v_bytes;    // bytes of the V tensor of this layer
    int32_t on_device;  // 1 if the tensors live in a non-host (accelerator) buffer
};

struct llama_kvp_obs_info {
    int32_t n_layer;    // observed layers (layers with a KV cache)
    int32_t n_head;     // query heads per layer
    int32_t n_head_kv;  // KV heads per layer
    int32_t n_cells;    // cells per layer (capacity)
    int32_t n_kv;       // cells covered by the last observation
    int32_t window;     // observation window
    int32_t n_queries;  // valid queries in the window at the last observation
    int32_t n_obs;      // observations made so far
    int32_t n_steps;    // ubatches processed so far
};

int32_t llama_kvp_api_version(void);

// thread-local message of the last failure on this thread ("" if none), and its reset
const char * llama_kvp_last_error(void);
void         llama_kvp_clear_error(void);

// defaults of a policy type
struct llama_kvp_policy llama_kvp_policy_default(int32_t type);

// parse "observe:window=32,every=4" into *out; returns 0, or -1 with a one-line error naming the bad key
int32_t llama_kvp_policy_parse(const char * spec, struct llama_kvp_policy * out);

// checks the parameters of a policy; returns 0, or -1 with the reason
int32_t llama_kvp_policy_validate(const struct llama_kvp_policy * policy);

// writes the canonical spec string of a policy (at most `size` bytes, NUL included); returns its length
int32_t llama_kvp_policy_to_string(const struct llama_kvp_policy * policy, char * buf, size_t size);

// the next llama_context created on this thread takes this policy (NULL clears it)
int32_t llama_kvp_set_pending(const struct llama_kvp_policy * policy);
void    llama_kvp_clear_pending(void);

// the policy of a context (type NONE if it has none)
int32_t llama_kvp_get_policy(struct llama_context * ctx, struct llama_kvp_policy * out);

// number of KV-cache layers of the context, then their stats (works for any context, with or without a policy)
int32_t llama_kvp_n_layers(struct llama_context * ctx);
int32_t llama_kvp_get_layer_stats(struct llama_context * ctx, struct llama_kvp_layer_stats * out, int32_t n_max);

// positions held by the cells of the KV cache (-1 for an empty cell); returns the number of cells written
int32_t llama_kvp_cell_pos(struct llama_context * ctx, int32_t * out, int32_t n_max);

// positions the cells held at the last observation (-1: empty); returns the number of cells written
int32_t llama_kvp_obs_cell_pos(struct llama_context * ctx, int32_t * out, int32_t n_max);

// observation results (policy with observation only); call after llama_decode, they synchronize the context
int32_t llama_kvp_obs_info(struct llama_context * ctx, struct llama_kvp_obs_info * out);
// entropy (nats) of each query head's attention, averaged over the window queries: out[n_layer*n_head]
int32_t llama_kvp_obs_entropy(struct llama_context * ctx, float * out, size_t n);
// attention mass of each cell, averaged over the window queries: out[n_layer*n_head*n_cells], cell fastest
int32_t llama_kvp_obs_mass(struct llama_context * ctx, float * out, size_t n);
// accumulated (decayed) mass of each cell, averaged over heads: out[n_layer*n_cells]
int32_t llama_kvp_obs_mass_acc(struct llama_context * ctx, float * out, size_t n);
// make the next single-token decode step observe, whatever `every` says
int32_t llama_kvp_obs_request(struct llama_context * ctx);

// cffi-end

#ifdef __cplusplus
}
#endif
