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

#define LLAMA_KVP_API_VERSION 23

#ifdef __cplusplus
extern "C" {
#endif

// cffi-begin (the lines up to cffi-end are read by bindings/llama_kvp_ffi.py; plain C declarations only)

struct llama_context;

// A policy is a composition of stages, one per slot: how the budget is split over layers, how tokens are scored,
// when the scores are refreshed, what happens to a token that leaves a layer's cache, and how a prompt is processed.
// Each stage lives in one file (native/engine/stages/). The presets below are named compositions; a spec starts with
// a preset and may replace stages with "+stage:key=value,...", e.g. "snapkv:budget=0.1+entropy:min_layer=64".

enum llama_kvp_policy_type { // presets
    LLAMA_KVP_POLICY_NONE        = 0, // full cache, no observation
    LLAMA_KVP_POLICY_OBSERVE     = 1, // full cache + in-graph attention observation (telemetry)
    // retention presets: one KV cache per layer, sized to the layer's budget (llama-kvp-memory.cpp)
    LLAMA_KVP_POLICY_SINK_RECENT = 2, // first n_sink + last n_recent tokens (StreamingLLM)
    LLAMA_KVP_POLICY_SNAPKV      = 3, // uniform budget, top-k by pooled observation-window attention
    LLAMA_KVP_POLICY_H2O         = 4, // uniform budget, top-k by attention accumulated over decoding
    LLAMA_KVP_POLICY_PYRAMID     = 5, // fixed linearly decreasing layer budgets, SnapKV scores
    LLAMA_KVP_POLICY_ENTROPY     = 6, // layer budgets in proportion to mean head entropy, top-k + sinks + recent
    LLAMA_KVP_POLICY_FREEZE      = 7, // every token kept, low-relevance tokens frozen into the host tier for a while (ASR-KF)
};

enum llama_kvp_slot {
    LLAMA_KVP_SLOT_BUDGET   = 0, // layer budget allocation (none: llama.cpp's full cache)
    LLAMA_KVP_SLOT_SCORE    = 1, // token scoring and the tokens always kept (none: nothing observed)
    LLAMA_KVP_SLOT_SCHEDULE = 2, // when scores are refreshed during decoding
    LLAMA_KVP_SLOT_FATE     = 3, // what happens to tokens leaving a layer's cache
    LLAMA_KVP_SLOT_PREFILL  = 4, // how a prompt is processed
    LLAMA_KVP_SLOT_COUNT    = 5,
};

enum llama_kvp_stage_id {
    LLAMA_KVP_STAGE_NONE        = 0,  // empty slot
    LLAMA_KVP_BUDGET_UNIFORM    = 1,  // every layer gets the mean budget
    LLAMA_KVP_BUDGET_PYRAMID    = 2,  // linearly decreasing over layers (slope)
    LLAMA_KVP_BUDGET_ENTROPY    = 3,  // in proportion to the mean head entropy of the prompt
    LLAMA_KVP_SCORE_RECENCY     = 10, // sinks + most recent tokens, nothing observed
    LLAMA_KVP_SCORE_WINDOW      = 11, // attention of the last `window` queries, pooled over positions
    LLAMA_KVP_SCORE_ACCUMULATED = 12, // attention accumulated over observations (heavy hitters)
    LLAMA_KVP_SCHEDULE_PROMPT   = 20, // observe prompt batches only
    LLAMA_KVP_SCHEDULE_EVERY    = 21, // also every `every` decode steps
    LLAMA_KVP_SCHEDULE_FREEZE   = 22, // every decode step; tokens of low attention freeze for floor(sqrt(c)/k) steps
    LLAMA_KVP_SCHEDULE_LATENT   = 23, // as `every`; `gap` tokens after a prompt, active and host tokens re-ranked together
    LLAMA_KVP_FATE_DROP         = 30, // leaving tokens are gone
    LLAMA_KVP_FATE_SUMMARISE    = 31, // leaving tokens are binned, each full bin replaced by `rank` fitted centroid cells
    LLAMA_KVP_FATE_HOST         = 32, // leaving tokens move to a host-memory tier (raw K/V bytes) and can come back
    LLAMA_KVP_PREFILL_DENSE     = 40, // dense attention, prompt in chunks (guided by the prompt's end with `guide`)
    LLAMA_KVP_PREFILL_SPARSE    = 41, // per-head entropy-guided block-sparse attention in prompt ubatches (EntropyInfer)
};

// the stages and the values of every key of the spec grammar; each stage reads the keys it names
struct llama_kvp_policy {
    int32_t type;       // the preset this composition starts from (enum llama_kvp_policy_type)
    int32_t stage[5];   // stage of each slot (enum llama_kvp_stage_id), indexed by enum llama_kvp_slot
    int32_t window;     // observation window: the last `window` queries of the sequence (>= 1)
    int32_t every;      // also observe every `every` single-token decode steps (0 = prompt batches only)
    float   decay;      // accumulated mass: acc = decay*acc + mass at each observation, in [0, 1]
    float   budget;     // retained tokens per layer on average: a count (>= 1) or a fraction of the prompt (0, 1)
    int32_t n_sink;     // first tokens always kept
    int32_t n_recent;   // most recent tokens always kept
    int32_t min_layer;  // entropy: smallest layer budget (0 = budget/4)
    int32_t max_layer;  // entropy: largest layer budget (0 = 2*budget)
    float   split_share; // entropy: share of the layers, from the first, whose budgets follow entropy (the others keep
                         // the mean budget), in (0, 1]
    float   topk_share; // share of the layer budget (after sinks) chosen by attention mass, in [0, 1]
    int32_t pool;       // width of the pooling of the scores over positions (odd, 1 = none)
    float   pool_max;   // share of the top-k kept as whole spans (max pooling around the best-attended tokens), the
                        // rest by average pooling, in [0, 1]: 0 = average (SnapKV), 1 = max everywhere
    int32_t span_pool;  // width of the max pooling that forms those spans (odd, 0 = pool)
    float   span_share; // share of the layers, from the last, whose top-k takes those spans (the others average only),
                        // in (0, 1]
    int32_t fill;       // holes of up to `fill` tokens between two better-scored tokens rank with the weaker of the two
                        // (a closing of the scores: a number or a name is not cut in the middle), 0 = off
    float   fill_share; // share of the layers, from the last, whose holes are filled, in (0, 1]
    float   vnorm;      // a token's observed mass is weighted by the norm of its value vectors (mean over the KV
                        // heads) to this power, in [0, 4]: 0 = attention only, 1 = attention x value norm (VATP)
    float   fresh;      // share of the last observation alone in the score of the top-k outside the spans, in [0, 1]
                        // (the rest: the decayed sum, which alone ranks the spans: a fact the prompt's question
                        // attended stays): 0 = every token by the decayed sum, 1 = the others by the last observation
    float   slope;      // pyramid: first layer gets budget*(1+slope), last budget*(1-slope), in [0, 1)
    int32_t chunk;      // retention: tokens per prompt ubatch (the headroom of each layer's cache)
    int32_t guide;      // retention: 1 = score each prompt chunk with the prompt's last `window` tokens run behind it
    int32_t segment;    // sparse: query tokens per segment (the unit of selection)
    int32_t block;      // sparse: KV cells per key block (divides 256)
    int32_t base;       // sparse: tokens per segment of a Rigid head (the smallest budget; Dynamic heads up to 3*base)
    float   e_t;        // sparse: normalised block entropy in [0, 1] below which a head stays Rigid
    float   alpha;      // sparse: step of a Dynamic head's budget, in units of base
    float   delta_t;    // sparse: entropy growth a Dynamic head's budget ignores
    int32_t threshold;  // sparse: KV cells below which a prompt ubatch stays dense
    int32_t skip;       // sparse: first layers that stay dense
    int32_t per_head;   // sparse: 1 = each head its own block count, 0 = every head the layer's largest
    int32_t bin;        // summarise: leaving tokens per bin (>= 2)
    int32_t rank;       // summarise: centroid cells that replace a bin (1 <= rank < bin, <= the head size)
    float   tau;        // freeze: a token is of low relevance when its head-mean attention is below tau/n (n: tokens attended)
    int32_t k;          // freeze: a token of c low-relevance steps freezes for floor(sqrt(c)/k) steps (>= 1)
    int32_t hist;       // freeze: decode steps the low-relevance count c covers (a multiple of 64, <= 4096)
    int32_t limit;      // host: tokens per layer the host tier holds (0 = the context size); past it the coldest are dropped
    int32_t gap;        // latent, freeze: decode steps after a prompt (a chat turn) at which active and host tokens are re-ranked
                        // (0: at its end; freeze: -1 = never, its default)
    int32_t repeat;     // latent, freeze: 1 = re-rank again every `gap` decode steps, 0 = once per prompt
    float   z;          // freeze: recovery ladder on when > 0: a next-token entropy above mean + z*sd is a spike
    int32_t rewalk;     // freeze: tokens the ladder's last level rolls back and generates again (0: no Rewalk)
    int32_t span;       // freeze: decode steps a Window Reset reaches back, and calm steps after which the ladder resets
    float   lam;        // summarise: tokens leave by log(score) - lam*entropy, the entropy of their attention over the
                        // window's queries normalised to [0, 1] (the seed's score - lambda*entropy), in [0, 16]; 0 = by
                        // score alone; -1 (default) = 2 with a window of 2 or more queries, else 0
};

// what a policy is made of (names are static strings)
struct llama_kvp_policy_desc {
    const char * preset;   // preset name
    const char * stage[5]; // stage name per slot ("" for an empty slot)
    int32_t observes;      // 1: computes in-graph attention observations
    int32_t retains;       // 1: one budgeted KV cache per layer (evicts tokens)
    int32_t guides;        // 1: prompt chunks are guided by the prompt's end
    int32_t sparse;        // 1: prompt ubatches run block-sparse attention (prefill stage `sparse`)
    int32_t rerank_at_end; // 1: each prompt's end is re-ranked (gap=0 `latent`, or `freeze`): call llama_kvp_latent_prompt_end
};

// per layer of the KV cache, as allocated in the real ggml buffers
struct llama_kvp_layer_stats {
    int32_t il;         // model layer index
    int32_t n_cells;    // capacity (cells; of every stream where llama.cpp's cache has one per sequence)
    int32_t n_used;     // cells holding a token (every stream)
    int64_t k_bytes;    // bytes of the K tensor of this layer (every stream)
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
    // the decode observations of snapkv, pyramid and entropy (`every` steps) score by the head mean of the mass alone:
    // the per-head mass and the entropy stay those of the last observation that computed them (a prompt's, or a step
    // after llama_kvp_obs_request)
    int32_t n_obs_heads;   // the observation that last wrote the per-head mass (n_obs: the last one)
    int32_t n_obs_entropy; // the observation that last computed the entropy
    int32_t pos_last;      // the last query position of the last observation (-1: none)
    int32_t pos_entropy;   // the last query position of the entropy's observation
};

LLAMA_KVP_API int32_t llama_kvp_api_version(void);

// thread-local message of the last failure on this thread ("" if none), and its reset
LLAMA_KVP_API const char * llama_kvp_last_error(void);
LLAMA_KVP_API void         llama_kvp_clear_error(void);

// defaults of a policy type
LLAMA_KVP_API struct llama_kvp_policy llama_kvp_policy_default(int32_t type);

// parse a spec into *out; returns 0, or -1 with a one-line error naming the bad preset, stage or key. Grammar:
//   spec := part ("+" part)*      part := name [":" key "=" value ("," key "=" value)*]
// the first part names a preset, the others stages that replace the preset's stage in their slot; a stage part
// takes the stage's keys (its keys the preset does not expose start at the stage's defaults)
LLAMA_KVP_API int32_t llama_kvp_policy_parse(const char * spec, struct llama_kvp_policy * out);

// what a policy is made of; returns 0, or -1 for an invalid policy
LLAMA_KVP_API int32_t llama_kvp_policy_describe(const struct llama_kvp_policy * policy, struct llama_kvp_policy_desc * out);

// writes a listing of the presets and stages with their keys, one per line (at most `size` bytes, NUL included);
// returns its length
LLAMA_KVP_API int32_t llama_kvp_policy_help(char * buf, size_t size);

// checks the parameters of a policy; returns 0, or -1 with the reason
LLAMA_KVP_API int32_t llama_kvp_policy_validate(const struct llama_kvp_policy * policy);

// writes the canonical spec string of a policy (at most `size` bytes, NUL included); returns its length. It names
// the preset with every key it exposes, then each stage that differs from the preset's with its other keys, and
// parses back to the same policy; -1 (with the reason) for a policy llama_kvp_policy_validate refuses
LLAMA_KVP_API int32_t llama_kvp_policy_to_string(const struct llama_kvp_policy * policy, char * buf, size_t size);

// the next llama_context created on this thread takes this policy (NULL clears it)
LLAMA_KVP_API int32_t llama_kvp_set_pending(const struct llama_kvp_policy * policy);
LLAMA_KVP_API void    llama_kvp_clear_pending(void);

// the policy of a context (type NONE if it has none)
LLAMA_KVP_API int32_t llama_kvp_get_policy(struct llama_context * ctx, struct llama_kvp_policy * out);

// number of KV-cache layers of the context, then their stats (works for any context, with or without a policy)
LLAMA_KVP_API int32_t llama_kvp_n_layers(struct llama_context * ctx);
LLAMA_KVP_API int32_t llama_kvp_get_layer_stats(struct llama_context * ctx, struct llama_kvp_layer_stats * out, int32_t n_max);

// positions held by the cells of the KV cache (-1 for an empty cell); returns the number of cells written
LLAMA_KVP_API int32_t llama_kvp_cell_pos(struct llama_context * ctx, int32_t * out, int32_t n_max);

// positions the cells held at the last observation (-1: empty); returns the number of cells written
LLAMA_KVP_API int32_t llama_kvp_obs_cell_pos(struct llama_context * ctx, int32_t * out, int32_t n_max);

// observation results (policy with observation only); call after llama_decode, they synchronize the context; each
// writes all of its floats into out (n_max of room) and returns their count, or -1 (with the count needed)
LLAMA_KVP_API int32_t llama_kvp_obs_info(struct llama_context * ctx, struct llama_kvp_obs_info * out);
// entropy (nats) of each query head's attention, averaged over the window queries: out[n_layer*n_head]
LLAMA_KVP_API int32_t llama_kvp_obs_entropy(struct llama_context * ctx, float * out, int32_t n_max);
// attention mass of each cell, averaged over the window queries: out[n_layer*n_head*n_cells], cell fastest
LLAMA_KVP_API int32_t llama_kvp_obs_mass(struct llama_context * ctx, float * out, int32_t n_max);
// attention mass of each cell at the last observation, averaged over heads and the window queries: out[n_layer*n_cells]
LLAMA_KVP_API int32_t llama_kvp_obs_mass_last(struct llama_context * ctx, float * out, int32_t n_max);
// accumulated (decayed) mass of each cell, averaged over heads: out[n_layer*n_cells]
LLAMA_KVP_API int32_t llama_kvp_obs_mass_acc(struct llama_context * ctx, float * out, int32_t n_max);
// make the next single-token decode step observe, whatever `every` says
LLAMA_KVP_API int32_t llama_kvp_obs_request(struct llama_context * ctx);

// --- sparse prefill (prefill stage `sparse`) ---

struct llama_kvp_sparse_info {
    int32_t n_layer;    // layers with a KV cache
    int32_t n_head;     // query heads per layer
    int32_t n_seg;      // segments of the sequence so far (rows of the budgets and entropies)
    int32_t segment;    // query tokens per segment
    int32_t block;      // KV cells per key block
};

LLAMA_KVP_API int32_t llama_kvp_sparse_info(struct llama_context * ctx, struct llama_kvp_sparse_info * out);

// telemetry of the sequence's prompt ubatches that ran sparse (synchronizes); any output may be NULL:
//   counts[n_layer*3]            key blocks computed, key blocks a dense attention computes, sparse ubatches
//   dynamic[n_layer*n_head]      1 for a Dynamic head, 0 for a Rigid one (after the last segment)
//   budgets[n_layer*n_seg*n_head] tokens per segment and head; entropy[...]: normalised block entropy
LLAMA_KVP_API int32_t llama_kvp_sparse_telemetry(struct llama_context * ctx, float * counts, float * dynamic, float * budgets, float * entropy, int32_t n_seg);

// --- retention policies (one KV cache per layer) ---

struct llama_kvp_memory_info {
    int32_t per_layer;  // 1 if the context holds one KV cache per layer (a retention policy)
    int32_t budget;     // resolved mean budget per layer (tokens)
    int32_t n_prompt;   // prompt length a fractional budget was resolved against (0: n_ctx)
    int32_t chunk;      // tokens per prompt ubatch
    int64_t bytes;      // K+V bytes allocated now, all layers (ggml buffers)
    int64_t bytes_peak; // largest K+V bytes allocated at any time since creation (resizes included)
    int64_t n_evicted;  // cells evicted so far, all layers
    int32_t n_resize;   // per-layer cache reallocations so far
    int32_t n_budget;   // layer budget decisions (entropy policy) so far
    int64_t host_bytes;      // host memory of the fate stage's K+V now, not in `bytes`: the host tier's tokens (fate
                             // stage `host`) or summarise's pending bins (as allocated, up to `bin` rows per layer)
    int64_t host_bytes_peak; // largest host_bytes at any time
    int32_t n_active;   // tokens the layer caches hold now, all layers (the host tier's are not counted; without a
                        // retention policy, llama.cpp's cells in use times its layers)
    int32_t n_seq;      // sequences the context holds (n_seq_max), each in caches of its own; `bytes` and
                        // `bytes_peak` count all of them, budget, n_prompt and n_active the current one
    int32_t seq;        // the current sequence (see llama_kvp_seq_select)
};

struct llama_kvp_layer_budget {
    int32_t il;         // model layer index
    int32_t budget;     // tokens this layer keeps
    int32_t capacity;   // cells allocated for this layer
    int32_t n_used;     // cells holding a token
    float   entropy;    // mean head entropy that decided the budget (nats, 0 before the first decision)
    int64_t n_evicted;  // cells evicted from this layer so far
};

// before a new prompt (cache empty): resolves a fractional budget against n_prompt and resizes the layer caches
LLAMA_KVP_API int32_t llama_kvp_set_prompt_len(struct llama_context * ctx, int32_t n_prompt);

// before a new prompt of n_prompt tokens on a cache that holds a previous sequence whose first n_want tokens equal the
// prompt's: keeps the longest prefix (<= n_want) whose state is the one a fresh evaluation of the prompt reaches
// there, removes the rest and restarts the policy for the prompt (budgets, scores, decode schedule). Returns the
// positions kept: the caller evaluates the prompt from there (0: the cache is empty, evaluate it all).
LLAMA_KVP_API int32_t llama_kvp_prompt_reuse(struct llama_context * ctx, int32_t n_prompt, int32_t n_want);

// several sequences (a context with n_seq_max > 1): every sequence has layer caches, budgets, scores and stage state
// of its own, as if it had a context of n_ctx/n_seq_max tokens; each token of a batch belongs to one sequence. The
// functions of this header act on the current sequence: the one whose tokens were decoded last, or the one this
// selects (e.g. before llama_kvp_set_prompt_len or the telemetry of a sequence).
LLAMA_KVP_API int32_t llama_kvp_seq_select(struct llama_context * ctx, int32_t seq_id);

LLAMA_KVP_API int32_t llama_kvp_memory_info(struct llama_context * ctx, struct llama_kvp_memory_info * out);

// starts a new peak: bytes_peak = bytes now (e.g. after llama_kvp_set_prompt_len, to measure one prompt)
LLAMA_KVP_API int32_t llama_kvp_reset_peak(struct llama_context * ctx);

// host time of the policy: the memory's and the observation's own work around llama.cpp's graphs (as
// llama_perf_context_data times llama.cpp's), summed since the context was created or llama_kvp_perf_reset. A backend
// that computes asynchronously (a GPU) may still be running the previous graph when the policy synchronizes to read
// what it wrote (observations, K/V): that wait is t_wait_ms, and the four parts do not count it (over RPC the wait
// happens in the first read instead, ggml-rpc's synchronize not waiting for the server, and stays in the parts)
struct llama_kvp_perf_data {
    double  t_prepare_ms; // before each ubatch: budgets, the schedule, evictions and the fate stage's work (reads, fits, moves)
    double  t_slot_ms;    // before each ubatch: its cells found in every layer's cache
    double  t_input_ms;   // graph inputs the policy sets: per-layer cell indices and masks, the observation's inputs
    double  t_settle_ms;  // after a prompt's last ubatch: its end evicted there (a fate stage that settles it)
    double  t_wait_ms;    // within those parts: waiting for the backends to finish earlier graphs (~0 on the CPU)
    int32_t n_ubatch;     // ubatches a retention policy's memory prepared (0 without one)
};

LLAMA_KVP_API int32_t llama_kvp_perf(struct llama_context * ctx, struct llama_kvp_perf_data * out);
LLAMA_KVP_API int32_t llama_kvp_perf_reset(struct llama_context * ctx);

// question-guided prefill (policy with guide = 1): decodes tokens[0..k) at positions pos0.. in chunks, running the
// prompt's last `window` tokens behind each chunk (at the positions that follow it, then removed) so that every chunk
// is scored by the end of the prompt, as SnapKV scores a whole prompt. Returns k; the caller decodes tokens[k..n)
// itself (one chunk that ends with those tokens, with the logits it wants). 0 when there is nothing to guide.
LLAMA_KVP_API int32_t llama_kvp_prefill_guided(struct llama_context * ctx, const int32_t * tokens, int32_t n_tokens, int32_t pos0);
// the same, with the logits of tokens[0..k) written to logits [k][n_vocab] (NULL: none), for a caller that keeps every
// token's logits (llama-cpp-python's logits_all); the guide behind a chunk does not change its tokens' logits
LLAMA_KVP_API int32_t llama_kvp_prefill_guided_logits(struct llama_context * ctx, const int32_t * tokens, int32_t n_tokens, int32_t pos0,
                                        float * logits);
// one chunk of that: decodes the guided chunk that starts at tokens[i0] (i0 = 0 first, then each return value) and
// returns where the next starts: i0 itself when there is none (i0 = k: done; 0 with nothing to guide), -1 on an
// error. A caller that loops over it can stop between chunks (an interrupt) with tokens[0..i0) in the cache
LLAMA_KVP_API int32_t llama_kvp_prefill_guided_next(struct llama_context * ctx, const int32_t * tokens, int32_t n_tokens, int32_t pos0,
                                        int32_t i0, float * logits);

// the position of the prompt's last token (-1: none said). Where it is said, the prompt's end is that token's ubatch,
// not the last ubatch that asks for logits: summarise fits its bins' rest there and sparse prefill attends to every
// block in that token's segment alone, so that asking logits for every token (logits_all) changes nothing else
LLAMA_KVP_API int32_t llama_kvp_set_prompt_end(struct llama_context * ctx, int32_t pos);

// per-layer budgets of a retention policy; returns the number of layers written
LLAMA_KVP_API int32_t llama_kvp_get_budgets(struct llama_context * ctx, struct llama_kvp_layer_budget * out, int32_t n_max);

// positions held by the cells of KV layer ikv (-1: empty); returns the number of cells written
LLAMA_KVP_API int32_t llama_kvp_layer_cell_pos(struct llama_context * ctx, int32_t ikv, int32_t * out, int32_t n_max);

// splits total tokens over n_layer layers in proportion to entropy, each within [min_layer, max_layer], summing to
// total exactly (pure function, used by the entropy policy); returns 0, or -1 if the bounds make it impossible
LLAMA_KVP_API int32_t llama_kvp_allocate_budgets(const float * entropy, int32_t n_layer, int64_t total,
                                   int32_t min_layer, int32_t max_layer, int32_t * out);

// the tokens layer il of n_layer keeps out of n (in position order, with the observed attention mass of each, the
// mass of the last observation alone, NULL: the same, and the norm of its value vectors, NULL: all 1) when it keeps
// n_keep of them: keep[j] = 1 or 0 (pure function: the score stage's sinks, recent tokens and top-k by its scores)
LLAMA_KVP_API int32_t llama_kvp_select_tokens(const struct llama_kvp_policy * p, int32_t il, int32_t n_layer, const float * mass,
                                const float * last, const float * value, int32_t n, int32_t n_keep, int32_t * keep);

// --- summarise fate (fate stage `summarise`) ---

struct llama_kvp_summary_stats {
    int64_t n_bins;       // bins replaced by centroids, all layers
    int64_t n_fallback;   // bins dropped instead because their fit failed (singular or not finite)
    int64_t n_dropped;    // centroid cells dropped: evicted in turn, or no cell left for them when their bin was fitted
    int64_t n_tokens;     // tokens summarised (in the bins replaced)
    int32_t n_pending;    // tokens waiting in partly filled bins (held in host memory, not in the cache)
    int32_t n_centroids;  // centroid cells in the caches now
    int64_t pending_bytes; // host bytes of the pending tokens' K/V (q8_0; the bins' allocation is memory_info's host_bytes)
    float   fit_err;      // mean relative error of the bins' attention outputs on the reference queries
    float   fit_lse_err;  // mean absolute error of the bins' log attention mass on the reference queries (nats)
    double  t_ms;         // time spent reading, fitting and writing bins (ms)
};

// counters of the summarise fate over all layers; returns 0, or -1 if the policy does not summarise
LLAMA_KVP_API int32_t llama_kvp_summary(struct llama_context * ctx, struct llama_kvp_summary_stats * out);

// positions of the tokens KV layer ikv holds summarised: those of the bins replaced by centroids that still have a
// centroid cell in the layer (a bin whose centroids all left is dropped); returns their count (the positions written
// are the first n_max)
LLAMA_KVP_API int32_t llama_kvp_layer_summarised(struct llama_context * ctx, int32_t ikv, int32_t * out, int32_t n_max);

// positions of the tokens waiting in KV layer ikv's bin (left the cache, in host memory, not fitted yet); returns
// their count (the positions written are the first n_max)
LLAMA_KVP_API int32_t llama_kvp_layer_pending(struct llama_context * ctx, int32_t ikv, int32_t * out, int32_t n_max);

// mask bias of each cell of KV layer ikv: log of the tokens a centroid cell stands for, 0 for a token's own cell;
// returns the number of cells written
LLAMA_KVP_API int32_t llama_kvp_layer_cell_bias(struct llama_context * ctx, int32_t ikv, float * out, int32_t n_max);

// fits `rank` centroids that replace n tokens of one KV head (pure function, used by the summarise fate): q [m][d]
// reference queries, k [n][d], v [n][dv] (row-major, split into `rank` runs of consecutive rows, run r of
// (r+1)*n/rank - r*n/rank rows: the summarise fate orders the rows so that a run holds similar keys); writes k_out [rank][d], v_out [rank][dv], the count of tokens of each run in cnt_out [rank] and the fit's
// errors in err_out[2] (relative output error, mean |log mass error|); returns 0, or -1 if the fit failed
LLAMA_KVP_API int32_t llama_kvp_summarise_fit(const float * q, int32_t m, const float * k, const float * v, int32_t n, int32_t d, int32_t dv,
                                float scale, int32_t rank, float * k_out, float * v_out, int32_t * cnt_out, float * err_out);

// --- host tier (fate stage `host`, schedule stage `freeze`) ---

struct llama_kvp_host_stats {
    int32_t n_active;        // tokens in the layer caches now, all layers
    int32_t n_host;          // tokens in the host tier now, all layers
    int32_t n_frozen;        // of those, frozen with a timer (they thaw by themselves)
    int64_t host_bytes;      // K+V bytes the host tier holds now (raw cache bytes)
    int64_t host_bytes_peak; // largest host bytes at any time
    int64_t n_freeze;        // tokens frozen so far by the freeze schedule (all layers)
    int64_t n_thaw;          // tokens thawed so far (back into a layer cache)
    int64_t n_evict;         // tokens moved to the host tier by the budget's eviction
    int64_t n_dropped;       // tokens dropped for good from the host tier (its limit)
    int32_t n_steps;         // decode steps since the cache was emptied or restarted
    int64_t n_rerank;        // latent re-rankings (per layer) so far
    int64_t n_promote;       // host tokens made active again by a re-ranking
    int32_t n_recover[4];    // recovery ladder events by level: Soft Reset, Window Reset, Full Reset, Rewalk
    double  t_ms;            // time spent deciding and moving tokens (ms)
};

// counters of the host tier over all layers; returns 0, or -1 if the policy has no host tier
LLAMA_KVP_API int32_t llama_kvp_host(struct llama_context * ctx, struct llama_kvp_host_stats * out);

// the tokens of KV layer ikv in the host tier: positions and timers (0: cold, > 0: decode steps until it thaws);
// returns their count (the first n_max are written; either output may be NULL)
LLAMA_KVP_API int32_t llama_kvp_layer_host(struct llama_context * ctx, int32_t ikv, int32_t * pos, int32_t * timer, int32_t n_max);

// moves every token of the host tier back into the layer caches as far as their cells allow (a budget's eviction
// may send some back at the next step) and clears the freeze counts; returns the tokens thawed
LLAMA_KVP_API int32_t llama_kvp_host_thaw_all(struct llama_context * ctx);

// the entropy recovery ladder (schedule stage `freeze` with z > 0; ASR-KF-EGR §3.6): after each generated token,
// pass the logits it was sampled from. The entropy of that distribution is compared with its running mean + z*sd;
// each spike climbs one level and acts: 1 Soft Reset (thaw the tokens frozen for more than one more step), 2 Window
// Reset (thaw every token frozen in the last `span` steps), 3 Full Reset (thaw everything, clear the counts), 4 Rewalk
// (a Full Reset, and the caller rolls back its last `rewalk` tokens and generates them again: it must remove their
// positions). `span` calm steps bring the ladder back down. Returns the level acted on (0: none), -1 on error.
LLAMA_KVP_API int32_t llama_kvp_recover_step(struct llama_context * ctx, const float * logits, int32_t n_vocab);

// the ladder's events so far: decode step, level (1-4) and the entropy (nats) that set it off; returns their count
// (the first n_max are written; any output may be NULL)
LLAMA_KVP_API int32_t llama_kvp_recover_events(struct llama_context * ctx, int32_t * step, int32_t * level, float * entropy, int32_t n_max);

// latent re-ranking now (schedule stage `latent`, or `freeze` with gap >= 0): each layer keeps the best of its active and
// host tokens for the observation window's queries; returns 0, or -1 if the policy re-ranks nothing
LLAMA_KVP_API int32_t llama_kvp_latent_rerank(struct llama_context * ctx);

// the end of a prompt, for a policy that re-ranks there (llama_kvp_policy_desc.rerank_at_end: gap=0): the caller (Python's
// Llama, kvbench) has just evaluated tokens[0..n_tokens) at positions pos0.. of the current sequence; every layer is
// re-ranked by the prompt's end, its last `window` tokens are evaluated again so that their queries see what came back
// (only its last token unless `pruned`: where no eviction reached the prompt, its tokens saw their whole context), the
// layers are re-ranked again and the last token evaluated again, with its logits as llama_get_logits_ith(ctx, -1).
// `logits` (may be NULL) takes the rows of the tokens evaluated again ([n_tokens][n_vocab], as the prompt's). Returns the
// most tokens evaluated again, 0 for any other policy or a prompt of one token, -1 on error
LLAMA_KVP_API int32_t llama_kvp_latent_prompt_end(struct llama_context * ctx, const int32_t * tokens, int32_t n_tokens, int32_t pos0,
                                    int32_t pruned, float * logits);

// raw K and V bytes of the cell of KV layer ikv that holds pos, in the cache's types and basis (k_out, v_out may be NULL; each
// must hold the count a call with NULL outputs returns); returns the K bytes + V bytes, 0 if no cell holds pos, -1
// on error
LLAMA_KVP_API int64_t llama_kvp_layer_cell_kv(struct llama_context * ctx, int32_t ikv, int32_t pos, void * k_out, void * v_out);

// K and V of every cell of KV layer ikv (the per-layer memory's or llama.cpp's own cache), as f32 rows: k_out
// [n_max][n_embd_k], v_out [n_max][n_embd_v] (either may be NULL), cells in the order of llama_kvp_layer_cell_pos;
// writes the row sizes (n_embd_k_gqa, n_embd_v_gqa) where the pointers are not NULL; returns the number of cells, -1 on
// error (more cells than n_max with an output given). Rows are in the model's basis: where llama.cpp rotates a quantized
// cache's rows (a Walsh-Hadamard matrix per 64 or more values), the rotation is undone.
LLAMA_KVP_API int32_t llama_kvp_layer_kv(struct llama_context * ctx, int32_t ikv, float * k_out, float * v_out, int32_t n_max,
                           int32_t * n_embd_k, int32_t * n_embd_v);

// the post-RoPE queries the observation window of KV layer ikv holds (every query head): q_out [n_max][n_head*n_embd_head]
// (head-major within a row; may be NULL) and their positions in pos_out (may be NULL); writes the row size and the
// layer's attention scale where the pointers are not NULL; returns the number of queries, -1 on error (the policy does
// not observe, or more queries than n_max with an output given); in the model's basis, as llama_kvp_layer_kv's K
LLAMA_KVP_API int32_t llama_kvp_obs_queries(struct llama_context * ctx, int32_t ikv, float * q_out, int32_t * pos_out, int32_t n_max,
                              int32_t * n_embd_q, float * scale);

// per cell of KV layer ikv, now: the entropy of its token's head-mean attention over the observation window's queries
// that saw it, divided by the log of their number, in [0, 1] (-1: fewer than two queries saw it); the token order of
// summarise's `lam`. ent_out [n_max] and pos_out [n_max] (the cell's position, -1: empty; either may be NULL); returns
// the cells covered, -1 on error (the policy keeps no per-query rows: it does not observe, or has no per-layer memory,
// or a window of one query; or the buffers hold fewer than the cells)
LLAMA_KVP_API int32_t llama_kvp_obs_query_entropy(struct llama_context * ctx, int32_t ikv, float * ent_out, int32_t * pos_out, int32_t n_max);

// cffi-end

#ifdef __cplusplus
}
#endif
