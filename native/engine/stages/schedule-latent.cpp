// schedule-latent.cpp - schedule stage `latent` (EntropyInfer §4.3, latent decoding): the choice a retention policy
// made on the prompt is revisited once the answer has begun, so that a token compressed away before the question (or
// the answer) existed can come back.
//
// `gap` decode steps after a prompt ubatch (the prompt, or a later chat turn), before the step that processes the
// gap-th generated token, each layer scores its active tokens and the tokens of its host tier together, for the
// observation window's queries (the ring: the end of the prompt and the tokens generated so far; with gap=1 the end
// of the prompt alone, i.e. the question of a chat turn). The scores are attention probabilities of one softmax over
// all of them (scaled dot products with the model's scale, each query seeing the positions up to its own; softcap,
// ALiBi and attention sinks are not applied to this ranking), the largest over the heads and the mean over the queries,
// carried LLAMA_KVP_LATENT_REACH tokens forward (a question attends to a fact's key words, the answer is the value
// after them) and turned into eviction scores by the policy's score stage (its pooling). The layer then keeps what an
// eviction would keep from all of them: the sinks, the recent window and the best by score up to its budget. Host
// tokens that make it thaw into the cache; active tokens that do not go to the host tier (cold). With repeat=1 again
// every `gap` steps. With gap=0 the caller marks the end of each prompt (llama_kvp_latent_prompt_end, below): every
// layer is re-ranked by the prompt's end, the window's tokens are evaluated again so that the question's queries see
// what came back, and the layers are re-ranked with those better queries.
// Between re-rankings the scores are refreshed every `every` decode steps, as the `every` schedule does.
//
// It needs the host fate: the tokens a budget evicts must be kept to be re-ranked. The `freeze` schedule re-ranks the
// same way when its `gap` is set (>= 0), so that frozen and evicted tokens compete together (llama_kvp_latent_before_step).

#include "llama-kvp-impl.h"
#include "llama-kvp-memory.h"
#include "llama-kvp-stage.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <limits>
#include <string>

// how far forward an attended token lends its score in a re-ranking (tokens)
#define LLAMA_KVP_LATENT_REACH 8
// the share of an attended token's mass a token after it loses per token between them
#define LLAMA_KVP_LATENT_REACH_STEP 1e-3f

struct llama_kvp_schedule_latent : llama_kvp_schedule_stage {
    llama_kvp_schedule_latent() : llama_kvp_schedule_stage(LLAMA_KVP_SCHEDULE_LATENT, LLAMA_KVP_SLOT_SCHEDULE, "latent", "gap,repeat,every",
            "as `every`; `gap` decode steps after each prompt, active and host tokens are re-ranked together by the window's queries") {}

    void defaults(llama_kvp_policy & p) const override {
        p.gap    = 16;
        p.repeat = 0;
        p.every  = 16;
    }

    std::string check(const llama_kvp_policy & p) const override {
        char buf[192];
        if (p.gap < 0) {
            snprintf(buf, sizeof(buf), "gap must be >= 0 decode steps (got %d; 0: at the end of each prompt)", p.gap);
            return buf;
        }
        if (p.repeat != 0 && p.repeat != 1) {
            snprintf(buf, sizeof(buf), "repeat must be 0 (once per prompt) or 1 (every gap steps) (got %d)", p.repeat);
            return buf;
        }
        if (p.every < 0) {
            snprintf(buf, sizeof(buf), "every must be >= 0 (got %d; 0 observes prompt batches only)", p.every);
            return buf;
        }
        const auto * fate = llama_kvp_fate_of(p);
        if (!fate || fate->id != LLAMA_KVP_FATE_HOST) {
            return std::string("latent needs the host fate (+host): the tokens the budget evicts must be kept to be re-ranked (fate here: ") +
                   (fate ? fate->name : "none") + ")";
        }
        return "";
    }

    bool observe_step(const llama_kvp_policy & p, int32_t n_decode) const override {
        return p.every > 0 && (n_decode + 1) % p.every == 0;
    }

    void before_step(llama_kvp_memory & mem) const override {
        llama_kvp_latent_before_step(mem);
    }

    // every layer re-ranked now (gap=0: the caller does it at the end of a prompt, then evaluates its last token
    // again so that the next token's distribution sees the re-ranked cache); whether tokens moved between the tiers
    static bool rerank(llama_kvp_memory & mem, int32_t ikv) {
        llama_kvp_context * st = mem.st;
        auto & L = mem.layers[ikv];
        const llama_kvp_policy & p = mem.policy;

        std::vector<float>     q;
        std::vector<llama_pos> qpos;
        const int32_t n_q = llama_kvp_obs_layer_queries(st, ikv, q, &qpos);
        const float scale = st->layers[ikv].kq_scale;
        if (n_q == 0 || scale <= 0.0f || st->n_head_kv <= 0 || st->n_head % st->n_head_kv != 0) {
            return false;
        }
        std::vector<llama_pos> hpos;
        std::vector<float>     hk;
        llama_kvp_host_keys(mem, ikv, hpos, hk);
        if (hpos.empty()) {
            return false; // nothing to bring back
        }

        // every token of the layer: the active cells, then the host tier (idx = UINT32_MAX), with their keys
        ggml_tensor * kt = llama_kvp_kv_access::layer_k(*L.kv, 0);
        const int64_t n_embd_k = kt->ne[0];
        const uint32_t size = L.kv->get_size();
        std::vector<llama_kvp_cell> all;
        std::vector<uint32_t> act;
        for (uint32_t i = 0; i < size; ++i) {
            const llama_pos pi = llama_kvp_kv_access::cell_pos(*L.kv, i);
            if (pi >= 0) {
                all.push_back({ pi, i, 0.0f });
                act.push_back(i);
            }
        }
        const size_t n_act = act.size();
        std::vector<uint8_t> raw(n_act*llama_kvp_cell_bytes(kt, false));
        llama_kvp_cells_read(kt, false, size, act, raw.data());
        std::vector<float> keys((n_act + hpos.size())*n_embd_k);
        for (size_t i = 0; i < n_act; ++i) {
            llama_kvp_row_to_f32(kt->type, raw.data() + i*llama_kvp_cell_bytes(kt, false), keys.data() + i*n_embd_k, n_embd_k);
        }
        std::copy(hk.begin(), hk.end(), keys.begin() + n_act*n_embd_k);
        for (size_t i = 0; i < hpos.size(); ++i) {
            all.push_back({ hpos[i], UINT32_MAX, 0.0f });
        }
        const size_t n = all.size();

        // attention probability of each token, one softmax per (query, head) over all of them: the largest over the
        // heads (the layer's one token set serves every head, and a retrieval head may be the only one that looks at
        // a fact), the mean over the queries
        const int32_t d  = st->n_embd_head;
        const int32_t g  = st->n_head/st->n_head_kv;
        std::vector<float> mass(n, 0.0f);
        std::vector<float> head_max(n);
        std::vector<float> lg(n);
        int32_t n_rows = 0;
        for (int32_t i = 0; i < n_q; ++i) {
            std::fill(head_max.begin(), head_max.end(), 0.0f);
            bool seen = false;
            for (int32_t h = 0; h < st->n_head; ++h) {
                const float * qi = q.data() + (size_t) i*st->n_head*d + (size_t) h*d;
                const int32_t hk_off = (h/g)*d;
                float mx = -std::numeric_limits<float>::infinity();
                for (size_t j = 0; j < n; ++j) {
                    if (all[j].pos > qpos[i]) {
                        lg[j] = -std::numeric_limits<float>::infinity();
                        continue;
                    }
                    const float * kj = keys.data() + j*n_embd_k + hk_off;
                    float dot = 0.0f;
                    for (int32_t e = 0; e < d; ++e) {
                        dot += qi[e]*kj[e];
                    }
                    lg[j] = scale*dot;
                    mx = std::max(mx, lg[j]);
                }
                if (!std::isfinite(mx)) {
                    continue;
                }
                double z = 0.0;
                for (size_t j = 0; j < n; ++j) {
                    lg[j] = std::isfinite(lg[j]) ? std::exp(lg[j] - mx) : 0.0f;
                    z += lg[j];
                }
                for (size_t j = 0; j < n; ++j) {
                    head_max[j] = std::max(head_max[j], (float) (lg[j]/z));
                }
                seen = true;
            }
            if (seen) {
                for (size_t j = 0; j < n; ++j) {
                    mass[j] += head_max[j];
                }
                n_rows++;
            }
        }
        if (n_rows == 0) {
            return false;
        }

        // what an eviction would keep from all of them, scored by the score stage
        std::vector<size_t> ord(n);
        for (size_t j = 0; j < n; ++j) {
            ord[j] = j;
        }
        std::sort(ord.begin(), ord.end(), [&](size_t a, size_t b) { return all[a].pos < all[b].pos; });
        std::vector<llama_kvp_cell> cells(n);
        std::vector<float>          raw_mass(n);
        for (size_t j = 0; j < n; ++j) {
            cells[j]       = all[ord[j]];
            raw_mass[j]    = mass[ord[j]]/(float) n_rows;
            cells[j].score = raw_mass[j];
        }
        uint32_t n_sink   = 0;
        uint32_t n_recent = 0;
        mem.stage_score->protect(p, L.budget, n_sink, n_recent);
        const uint32_t n_keep = std::min<uint32_t>((uint32_t) n, std::min<uint32_t>(L.budget, size > 1 ? size - 1 : 0));
        llama_kvp_clamp_protected(n_keep, n_sink, n_recent);
        // a value follows its key: a question attends to "the code for Quito is", not to the digits after it, so each
        // token inherits the best mass of the LLAMA_KVP_LATENT_REACH tokens before it, a little less for each token
        // between them, so that the key itself (an attention sink too, the first token) never loses its place to the
        // tokens after it on a tie, which the newer token wins
        for (size_t j = n; j-- > 0;) {
            for (size_t k = j >= LLAMA_KVP_LATENT_REACH ? j - LLAMA_KVP_LATENT_REACH : 0; k < j; ++k) {
                cells[j].score = std::max(cells[j].score, raw_mass[k]*(1.0f - LLAMA_KVP_LATENT_REACH_STEP*(float) (j - k)));
            }
        }
        // the re-ranking is one observation: a score stage that ranks by the last one (fresh) reads the same mass
        for (size_t j = 0; j < n; ++j) {
            cells[j].last = cells[j].score;
        }
        const size_t n_topk = n_keep - n_sink - n_recent;
        mem.stage_score->score(p, ikv, (int32_t) mem.layers.size(), n_sink, (uint32_t) (n - n_recent), (uint32_t) n_topk, cells);
        std::vector<bool> keep(n, false);
        for (uint32_t j = 0; j < n_sink; ++j) {
            keep[j] = true;
        }
        for (size_t j = n - n_recent; j < n; ++j) {
            keep[j] = true;
        }
        const std::vector<uint32_t> mid = llama_kvp_rank_middle(cells, n_sink, (uint32_t) (n - n_recent), (uint32_t) n_topk);
        for (size_t j = 0; j < n_topk; ++j) {
            keep[mid[j]] = true;
        }

        // active tokens that lose their place leave (cold), host tokens that win one come back; the others' scores
        // become the joint ones
        std::vector<llama_kvp_cell> leaving;
        std::vector<llama_pos>      back;
        std::vector<float>          back_score;
        std::vector<uint32_t>       stay_idx;
        std::vector<llama_pos>      stay_pos;
        std::vector<float>          stay_score;
        for (size_t j = 0; j < n; ++j) {
            const bool active = cells[j].idx != UINT32_MAX;
            if (active && !keep[j]) {
                leaving.push_back({ cells[j].pos, cells[j].idx, raw_mass[j] });
            } else if (!active && keep[j]) {
                back.push_back(cells[j].pos);
                back_score.push_back(raw_mass[j]);
            } else if (active) {
                stay_idx.push_back(cells[j].idx);
                stay_pos.push_back(cells[j].pos);
                stay_score.push_back(raw_mass[j]);
            }
        }
        llama_kvp_obs_cells_set_score(st, ikv, stay_idx.data(), stay_pos.data(), stay_score.data(), stay_idx.size());
        llama_kvp_host_freeze(mem, ikv, leaving, std::vector<int32_t>(leaving.size(), 0));
        const uint32_t used = llama_kvp_kv_access::n_used(*L.kv);
        llama_kvp_host_thaw_pos(mem, ikv, back, back_score, size > used + 1 ? size - used - 1 : 0);
        mem.n_rerank++;
        return !leaving.empty() || !back.empty();
    }
};

const llama_kvp_stage * llama_kvp_stage_schedule_latent() {
    static const llama_kvp_schedule_latent stage;
    return &stage;
}

void llama_kvp_latent_before_step(llama_kvp_memory & mem) {
    const llama_kvp_policy & p = mem.policy;
    const int32_t k = mem.n_since_prompt;
    const bool due = p.gap > 0 && (p.repeat ? (k + 1) % p.gap == 0 : k + 1 == p.gap);
    if (due && mem.st) {
        llama_kvp_latent_rerank_layers(mem);
    }
}

bool llama_kvp_latent_rerank_layers(llama_kvp_memory & mem) {
    bool moved = false;
    for (int32_t ikv = 0; ikv < (int32_t) mem.layers.size(); ++ikv) {
        moved = llama_kvp_schedule_latent::rerank(mem, ikv) || moved;
    }
    return moved;
}

bool llama_kvp_latent_reranks(const llama_kvp_policy & p) {
    const int32_t sched = p.stage[LLAMA_KVP_SLOT_SCHEDULE];
    return sched == LLAMA_KVP_SCHEDULE_LATENT || (sched == LLAMA_KVP_SCHEDULE_FREEZE && p.gap >= 0);
}

bool llama_kvp_latent_at_prompt_end(const llama_kvp_policy & p) {
    return llama_kvp_latent_reranks(p) && p.gap == 0;
}

int32_t llama_kvp_latent_rerun_end(llama_context * ctx, llama_kvp_memory & mem, const llama_token * tokens, int32_t n,
                                   llama_pos pos0, bool pruned, float * logits) {
    if (!llama_kvp_latent_at_prompt_end(mem.policy) || n < 2) {
        return 0;
    }
    const int32_t n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(llama_get_model(ctx)));
    const int32_t n_batch = (int32_t) llama_n_batch(ctx);
    // the window's tokens again only where they were computed on a pruned cache: a new prompt that no eviction
    // reached saw its whole context, which a re-ranking can only take away; then the last token, which the next reads
    // again; where nothing changes the cache it saw (no eviction during the prompt or before the next step, no token
    // moved between the tiers) the prompt's own logits stand: the last token alone gives other rounding than in its
    // batch, which a budget that never binds must not
    const int32_t k_redo[2] = { pruned ? std::max(1, std::min(n, (int32_t) mem.policy.window)) : 1, 1 };
    llama_batch batch = llama_batch_init(n_batch, 0, 1);
    int32_t res = 0;
    bool changed = pruned;
    for (const auto & L : mem.layers) {
        changed = changed || llama_kvp_kv_access::n_used(*L.kv) > L.budget; // the next step's preparation evicts
    }
    for (const int32_t k : k_redo) {
        llama_synchronize(ctx);
        changed = llama_kvp_latent_rerank_layers(mem) || changed;
        if (!changed) {
            continue;
        }
        llama_memory_seq_rm(llama_get_memory(ctx), mem.seq_cur, pos0 + n - k, -1);
        for (int32_t i0 = n - k; i0 < n && res >= 0; i0 += n_batch) {
            const int32_t m = std::min(n_batch, n - i0);
            batch.n_tokens = m;
            for (int32_t j = 0; j < m; ++j) {
                batch.token[j]     = tokens[i0 + j];
                batch.pos[j]       = pos0 + i0 + j;
                batch.n_seq_id[j]  = 1;
                batch.seq_id[j][0] = mem.seq_cur;
                batch.logits[j]    = logits || i0 + j == n - 1;
            }
            const int32_t ret = llama_decode(ctx, batch);
            if (ret != 0) {
                llama_kvp_set_error("latent re-ranking: llama_decode failed (" + std::to_string(ret) + ") at position " +
                        std::to_string(pos0 + i0));
                res = -1;
            }
            for (int32_t j = 0; ret == 0 && logits && j < m; ++j) {
                std::copy_n(llama_get_logits_ith(ctx, j), n_vocab, logits + (size_t) (i0 + j)*n_vocab);
            }
        }
        if (res < 0) {
            break;
        }
        res = std::max(res, k);
    }
    llama_batch_free(batch);
    return res;
}

//
// C API (llama-kvp.h): latent re-ranking
//

int32_t llama_kvp_latent_rerank(struct llama_context * ctx) {
    llama_kvp_memory * mem = llama_kvp_host_mem(ctx);
    if (!mem) {
        return -1;
    }
    if (!llama_kvp_latent_reranks(mem->policy)) {
        llama_kvp_set_error("latent re-ranking needs the latent schedule or freeze with gap >= 0 (e.g. snapkv:budget=0.1+host+latent:gap=0)");
        return -1;
    }
    llama_synchronize(ctx);
    llama_kvp_latent_rerank_layers(*mem);
    return 0;
}

int32_t llama_kvp_latent_prompt_end(struct llama_context * ctx, const int32_t * tokens, int32_t n_tokens, int32_t pos0,
                                    int32_t pruned, float * logits) {
    if (!llama_kvp_check_ctx(ctx)) {
        return -1;
    }
    auto * mem = dynamic_cast<llama_kvp_memory *>(ctx->get_memory());
    if (!mem || !llama_kvp_latent_at_prompt_end(mem->policy) || n_tokens < 2) {
        return 0; // nothing to do at a prompt's end
    }
    if (!tokens || pos0 < 0) {
        llama_kvp_set_error("latent_prompt_end: need the prompt's tokens and pos0 >= 0");
        return -1;
    }
    return llama_kvp_latent_rerun_end(ctx, *mem, tokens, n_tokens, pos0, pruned != 0, logits);
}
