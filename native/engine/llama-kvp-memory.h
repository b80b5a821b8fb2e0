// llama-kvp-memory.h - the memory of a context with a retention policy: one unmodified llama_kv_cache per attention
// layer, each sized to that layer's budget. Tokens are placed one ubatch at a time; before each ubatch every layer
// evicts its lowest-scored cells down to its budget (sinks and the recent window are always kept), so prompts longer
// than the budget run in chunks with bounded memory and generation can run past the physical capacity.
#pragma once

#include "llama-kvp-impl.h"
#include "llama-kvp-stage.h"

#include "llama-batch.h"
#include "llama-cparams.h"
#include "llama-kv-cache.h"
#include "llama-memory.h"

#include <limits>
#include <map>
#include <memory>
#include <vector>

// a position past every position (pos_exact of a cache that has evicted nothing)
static constexpr llama_pos LLAMA_KVP_POS_ALL = std::numeric_limits<llama_pos>::max();

struct llama_kvp_mem_layer {
    int32_t  il       = -1; // model layer index
    uint32_t budget   = 0;  // tokens kept after each eviction
    uint32_t capacity = 0;  // cells of the layer's cache
    float    entropy  = 0;  // mean head entropy of the last budget decision
    int64_t  n_evicted = 0;

    std::unique_ptr<llama_kv_cache> kv;

    // cells the fate stage added (e.g. summarise's centroids), by position: the bias their column of the attention
    // mask gets (log of the tokens a cell stands for)
    std::map<llama_pos, float> bias;

    // the cells holding those positions, as last found (emptied by every change of `bias`; mask_add_bias checks that
    // the cells still hold them and refinds them)
    struct bias_cell {
        uint32_t  idx;
        llama_pos pos;
        float     bias;
    };
    mutable std::vector<bias_cell> bias_cells;

    // the layer's tokens in position order as of its last eviction, and by cell the position its entry holds (-1: no
    // entry); the next eviction keeps the entries whose cell still holds that position and merges in the cells
    // placed since, instead of sorting the whole layer at every decode step (llama_kvp_memory::cells_in_order)
    std::vector<llama_kvp_cell> order;
    std::vector<llama_pos>      order_pos;

    std::unique_ptr<llama_kvp_layer_state> fate;  // the fate stage's own state of this layer (nullptr: none)
    std::unique_ptr<llama_kvp_layer_state> sched; // the schedule stage's own state of this layer (nullptr: none)
};

// the per-sequence state of the memory, for a sequence that is not the current one (see llama_kvp_memory::seq_use)
struct llama_kvp_mem_seq {
    std::vector<llama_kvp_mem_layer>       layers;
    std::unique_ptr<llama_kvp_layer_state> sched_state;

    uint32_t  budget         = 0;
    int32_t   n_prompt       = 0;
    int32_t   n_since_prompt = 0;
    int32_t   n_steps_total  = 0;
    bool      budgets_set    = false;
    llama_pos pos_end        = 0;
    llama_pos pos_exact      = LLAMA_KVP_POS_ALL;
};

// Several sequences (n_seq_max > 1): every sequence has its own set of per-layer caches, budgets, scores and stage
// state, as if it had a context of its own of n_ctx_seq tokens. The members below hold the state of the current
// sequence (seq_cur), and everything in the engine works on them; seq_use(s) parks it in seqs[seq_cur] and takes
// sequence s's from seqs[s] (and does the same with the observation state of the owning context). Prompts are
// split so that every ubatch holds tokens of one sequence, and applying a ubatch makes its sequence current.
class llama_kvp_memory : public llama_memory_i {
public:
    llama_kvp_memory(
            const llama_model         & model,
            const llama_memory_params & params,
            const llama_cparams       & cparams,
            const llama_kvp_policy    & policy);

    ~llama_kvp_memory() = default;

    //
    // llama_memory_i
    //

    llama_memory_context_ptr init_batch(llama_batch_allocr & balloc, uint32_t n_ubatch, bool embd_all) override;
    llama_memory_context_ptr init_full() override;
    llama_memory_context_ptr init_update(llama_context * lctx, bool optimize) override;

    bool get_can_shift() const override;

    void clear(bool data) override;

    bool seq_rm  (llama_seq_id seq_id,                              llama_pos p0, llama_pos p1) override;
    void seq_cp  (llama_seq_id seq_id_src, llama_seq_id seq_id_dst, llama_pos p0, llama_pos p1) override;
    void seq_keep(llama_seq_id seq_id)                                                          override;
    void seq_add (llama_seq_id seq_id,                              llama_pos p0, llama_pos p1, llama_pos shift) override;
    void seq_div (llama_seq_id seq_id,                              llama_pos p0, llama_pos p1, int d) override;

    llama_pos seq_pos_min(llama_seq_id seq_id) const override;
    llama_pos seq_pos_max(llama_seq_id seq_id) const override;

    std::map<ggml_backend_buffer_type_t, size_t> memory_breakdown() const override;

    void state_write(llama_io_write_i & io, llama_seq_id seq_id = -1, llama_state_seq_flags flags = 0) const override;
    void state_read (llama_io_read_i  & io, llama_seq_id seq_id = -1, llama_state_seq_flags flags = 0) override;

    //
    // pykvcache
    //

    // before a new prompt: resolve a fractional budget against the prompt length; false if the cache is not empty
    bool set_prompt_len(int32_t n_prompt);

    // prefix reuse (llama-kvp-reuse.cpp): keeps the longest prefix, of at most n_want positions, whose state is the
    // one a fresh evaluation of a new prompt of n_prompt tokens reaches there, removes the rest and restarts the
    // policy for that prompt; returns the positions kept (0: the cache was emptied, evaluate the prompt afresh)
    int32_t reuse_prefix(int32_t n_prompt, int32_t n_want);

    // make room for a ubatch of n_tokens in every layer: evict down to the budgets (deciding entropy budgets first)
    void prepare_ubatch(uint32_t n_tokens);

    // a ubatch was computed: where the fate stage asks for it (settles_prompt_end) and a prompt or a streamed chunk
    // ended in it (2+ tokens, the last giving logits), the layers evict down to their budgets now instead of at the
    // next step, so that the work on the prompt's last leavers (summarise's fits) is the prompt's
    void ubatch_done(const llama_ubatch & ubatch);

    // K+V bytes of all layer caches of all sequences now
    int64_t bytes() const;

    // makes sequence s the current one (0 <= s < n_seq())
    void seq_use(llama_seq_id s);

    // sequences the memory holds (n_seq_max)
    uint32_t n_seq() const { return (uint32_t) seqs.size(); }

    // the layers of sequence s (the current ones or the parked ones)
    const std::vector<llama_kvp_mem_layer> & layers_of(llama_seq_id s) const { return s == seq_cur ? layers : seqs[s].layers; }

    // for fate stages: frees cell idx of KV layer ikv; places a token at pos (whose attention mask column gets
    // `bias`) into a free cell of KV layer ikv and returns the cell, or -1 if none is free
    void    cell_free (int32_t ikv, uint32_t idx);
    int32_t cell_place(int32_t ikv, llama_pos pos, float bias);

    // places tokens at positions pos[i] (no mask bias) into free cells of KV layer ikv, in one pass over its cells;
    // idx[i] = the cell, or -1 when none was left
    void cells_restore(int32_t ikv, const std::vector<llama_pos> & pos, std::vector<int32_t> & idx);

    // moves the tokens of the highest cells of KV layer ikv into its lowest free cells, so that its attention spans
    // as few cells as it holds tokens (a graph attends to every cell up to the last one used)
    void compact(int32_t ikv);

    // free cells of KV layer ikv ahead of a ubatch of n_tokens (what its budget still allows)
    uint32_t n_room(int32_t ikv, uint32_t n_tokens) const;

    // adds the bias of the fate stage's cells of KV layer ikv to an attention mask over its first n_kv cells
    // (data: f32 or f16 rows of n_kv, n_rows rows; masked entries stay masked)
    void mask_add_bias(int32_t ikv, void * data, bool f16, int64_t n_kv, int64_t n_rows) const;

    // some layer's cache is off the host (an offloaded layer): graph inputs shared by the layers are copied there once
    bool off_host() const;

    const llama_model   & model;
    const llama_cparams   cparams;
    const llama_kvp_policy policy;

    const llama_memory_params params;

    llama_kvp_context * st = nullptr; // the policy state of the owning context (set by llama_kvp_context_init)

    // the stages of the policy
    const llama_kvp_budget_stage  * stage_budget  = nullptr;
    const llama_kvp_score_stage   * stage_score   = nullptr;
    const llama_kvp_schedule_stage * stage_schedule = nullptr; // nullptr: nothing observed
    const llama_kvp_fate_stage    * stage_fate    = nullptr;
    const llama_kvp_prefill_stage * stage_prefill = nullptr;

    std::vector<llama_kvp_mem_layer> layers;
    std::vector<int32_t>             layer_of_il; // model layer -> index into layers (-1: none)

    uint32_t budget   = 0; // resolved mean budget per layer
    int32_t  n_prompt = 0; // prompt length of a fractional budget (0: resolved against n_ctx)
    uint32_t chunk    = 0; // tokens per prompt ubatch
    uint32_t n_guide  = 0; // guided prefill: prompt-end tokens run behind each chunk (0: off)
    bool     guiding  = false; // a guided chunk is being decoded: one ubatch of up to chunk + n_guide tokens
    uint32_t n_pad    = 32;

    int64_t bytes_peak = 0;
    bool    prompt_seen = false; // a prompt length was set (the buffers sized before it, for n_ctx, are a placeholder)
    int64_t host_bytes      = 0; // K/V bytes in the host tier (fate stage `host`), all layers
    int64_t host_bytes_peak = 0;
    int64_t n_rerank        = 0; // latent re-rankings (schedule stage `latent`), per layer
    int32_t n_since_prompt  = 0; // decode steps since the last prompt ubatch
    uint32_t n_ubatch_cur   = 0; // tokens of the ubatch being prepared
    bool     ubatch_ends    = false; // the eviction settles a prompt's end (ubatch_done): nothing more comes before logits
    int32_t n_steps_total   = 0; // decode steps since the memory was created

    std::unique_ptr<llama_kvp_layer_state> sched_state; // the schedule stage's state of the whole memory (nullptr: none)
    int64_t n_evicted  = 0;
    int32_t n_resize   = 0;
    int32_t n_budget   = 0;
    bool    budgets_set = false; // entropy: budgets decided from an observation
    bool    budget_raised_said = false; // a fractional budget raised to the protected tokens was logged

    // the sequence's logical end (one past the last position placed), apart from the cells held: a truncation
    // (seq_rm p0..end) leaves the positions consistent even where the policy had evicted p0 - 1
    llama_pos pos_end   = 0;
    // positions [0, pos_exact) are held by every layer with the K/V a full cache's prompt evaluation holds (nothing had
    // been evicted when they were computed, none was computed alone in its ubatch); LLAMA_KVP_POS_ALL while neither
    llama_pos pos_exact = LLAMA_KVP_POS_ALL;

    llama_seq_id                   seq_cur = 0; // the sequence whose state the members above hold
    std::vector<llama_kvp_mem_seq> seqs;        // by sequence id: the parked state of every other sequence

    // a blob of a saved state: its length, then its bytes (the read throws naming what where it is corrupt)
    static void                 state_write_blob(llama_io_write_i & io, const std::vector<uint8_t> & blob);
    static std::vector<uint8_t> state_read_blob (llama_io_read_i  & io, const char * what);

private:
    // exchanges the current sequence's state with o's
    void seq_swap(llama_kvp_mem_seq & o);

    // a fresh sequence: empty caches of the budgets the policy starts with
    void seq_init(llama_kvp_mem_seq & o) const;

    // the current sequence only
    void clear_cur(bool data);
    bool seq_rm_cur(llama_pos p0, llama_pos p1);
    void state_write_cur(llama_io_write_i & io, llama_seq_id seq_id, llama_state_seq_flags flags) const;
    void state_read_cur (llama_io_read_i  & io, llama_seq_id seq_id, llama_state_seq_flags flags);

private:
    uint32_t resolve_budget(int32_t n_prompt) const;
    void     restart_budgets(int32_t n_prompt); // the fixed budgets of a prompt of n_prompt tokens (cells stay)
    void     set_budgets(const std::vector<uint32_t> & b); // also resizes the caches

    // per-layer budgets before anything is observed (the budget stage)
    std::vector<uint32_t> fixed_budgets(uint32_t mean) const;

    uint32_t capacity_for(uint32_t layer_budget) const;

    // smallest useful layer budget: the protected tokens and one scored token
    uint32_t layer_lo() const;

    std::unique_ptr<llama_kv_cache> make_cache(int32_t il, uint32_t size) const;

    // reallocate one layer's cache with `size` cells, moving its tokens (and their scores)
    void resize(int32_t ikv, uint32_t size);

    // the tokens of one layer in position order (score 0)
    void cells_in_order(int32_t ikv, std::vector<llama_kvp_cell> & cells);

    // evict the lowest-value cells of one layer until n_keep remain
    void evict(int32_t ikv, uint32_t n_keep);

    // the budgets from the prompt's attention entropy, if the budget stage follows it and a prompt ubatch was observed
    void decide_budgets();

    // every layer: evict down to its budget (less room for n_tokens coming; only where they do not fit unless
    // evict_all), resize where its capacity changed, then the fate stage's deferred work
    void evict_layers(uint32_t n_tokens, bool evict_all);

    // the value norms the observation did not compute (NaN in cells[].value: a cell the host filled or moved since, a
    // restored state), from the layer's V cache on the host
    void value_norms(int32_t ikv, std::vector<llama_kvp_cell> & cells);

    void note_bytes(int64_t extra);
};

// bytes one token takes in a cache tensor (its K row, its V row, or its elements of a transposed V)
size_t llama_kvp_cell_bytes(const ggml_tensor * t, bool trans);

// n values of type t at src as f32 (an f32 cache's rows are copied: ggml's f32 type has no to_float)
void llama_kvp_row_to_f32(ggml_type t, const void * src, float * dst, int64_t n);

// the bytes of cells idx[i] of a cache tensor (K, V, or a transposed V) to out + i*(bytes per token), and back; one
// backend read (and write) per call when the tensor is in device memory
void llama_kvp_cells_read (ggml_tensor * t, bool trans, uint32_t size, const std::vector<uint32_t> & idx, uint8_t * out);
void llama_kvp_cells_write(ggml_tensor * t, bool trans, uint32_t size, const std::vector<uint32_t> & idx, const uint8_t * src);

class llama_kvp_memory_context : public llama_memory_context_i {
public:
    llama_kvp_memory_context(llama_memory_status status);

    // full-cache context, used to reserve the worst-case graphs
    explicit llama_kvp_memory_context(llama_kvp_memory * mem);

    // batch processing context: each ubatch is placed when it is applied
    llama_kvp_memory_context(llama_kvp_memory * mem, std::vector<llama_ubatch> ubatches);

    bool next()  override;
    bool apply() override;

    llama_memory_status  get_status() const override;
    const llama_ubatch & get_ubatch() const override;

    // the context of KV layer ikv for the current ubatch
    const llama_kv_cache_context * layer_ctx(int32_t ikv) const { return ctxs[ikv].get(); }

    // ubatches of the decode call that belong to the current ubatch's sequence (a prompt split into ubatches
    // observes in each of them; one token of each of several sequences is a decode step of each)
    size_t n_ubatches() const;

    size_t n_layers() const { return ctxs.size(); }

    llama_kvp_memory * mem = nullptr;

private:
    llama_memory_status status;

    size_t i_cur = 0;

    std::vector<llama_ubatch> ubatches;

    std::vector<std::unique_ptr<llama_kv_cache_context>> ctxs;
};
