// llama-kvp-reuse.cpp - prefix reuse over a lossy cache: what a new prompt may keep of the cache a previous call left.
//
// llama-cpp-python (and llama-server) keep the longest common token prefix of the cached sequence and the new prompt
// and evaluate only the rest. A full cache holds that prefix as a fresh evaluation would; a retention policy's cache
// may not: tokens of the prefix may have been evicted, tokens computed after an eviction saw a pruned context, and the
// policy's scores, budgets and schedule were made for the previous prompt. Here a prefix is kept only as far as it is
// exactly the state a fresh evaluation of the new prompt reaches at that point; the rest is evaluated again:
//
//   - every layer holds every position of the prefix, computed before anything was evicted (pos_exact);
//   - a fresh evaluation of the new prompt evicts nothing before its end (the prompt fits in the smallest budget),
//     so the prefix's cells are all it would hold;
//   - a policy that observes makes its first decision from one observation of the prompt's last `window` queries
//     over all of its cells: the fresh prompt is one ubatch, and the queries of the prefix positions in that window
//     are still in the query ring (the suffix of at least one more token is evaluated as a prompt batch);
//   - a token computed alone in its ubatch (a decode step; a prompt's last token where the split leaves it alone)
//     rounds otherwise than one computed in a ubatch of two or more (llama.cpp's matrix-vector kernels; any two
//     ubatch sizes from two up give the same bits): the prefix holds no token computed alone (pos_exact stops at
//     the first, llama-kvp-memory.cpp), and the rest is evaluated so that exactly the tokens a fresh evaluation
//     computes alone are computed alone (llama-cpp-python's eval cuts a prompt into n_batch tokens, this memory each
//     of those into chunks);
//
// and the policy restarts as for a new prompt: budgets resolved against the new prompt's length, scores, entropies
// and the decode schedule forgotten. Anything else is evaluated afresh from an empty cache.

#include "llama-kvp-impl.h"
#include "llama-kvp-memory.h"

#include <algorithm>
#include <vector>

// the positions in [p0, p1) that an evaluation of those tokens as a prompt computes alone in their ubatch: cut into
// n_batch tokens from p0 (llama-cpp-python's eval), each cut into n_split (the memory's split)
static std::vector<llama_pos> llama_kvp_alone(llama_pos p0, llama_pos p1, llama_pos n_batch, llama_pos n_split) {
    std::vector<llama_pos> res;
    for (llama_pos a = p0; a < p1; a += n_batch) {
        const llama_pos b = std::min(a + n_batch, p1);
        for (llama_pos x = a; x < b; x += n_split) {
            if (std::min(x + n_split, b) - x == 1) {
                res.push_back(x);
            }
        }
    }
    return res;
}

int32_t llama_kvp_memory::reuse_prefix(int32_t n_prompt, int32_t n_want) {
    llama_pos r = std::min({ (llama_pos) n_want, (llama_pos) n_prompt - 1, pos_end, pos_exact });

    // a fresh evaluation of the prompt must not evict before its end
    const auto b = fixed_budgets(resolve_budget(n_prompt));
    if ((uint32_t) n_prompt > *std::min_element(b.begin(), b.end())) {
        r = 0;
    }

    if (st && st->observing() && r > 0) {
        const uint32_t n_ub = std::min({ chunk, cparams.n_ubatch, cparams.n_batch });
        r = (uint32_t) n_prompt <= n_ub ? std::min<llama_pos>(r, n_prompt - 2) : 0;

        const int32_t W = (int32_t) st->slot_pos.size();
        for (llama_pos p = std::max(0, n_prompt - W); p < r; ++p) {
            if (st->slot_pos[p % W] != p) {
                r = p;
                break;
            }
        }
    }

    if (r > 0) {
        // the tokens computed alone: none in the prefix, the same in the rest as in a fresh evaluation
        const llama_pos n_batch = (llama_pos) std::max<uint32_t>(1, cparams.n_batch);
        const llama_pos n_split = (llama_pos) std::max<uint32_t>(1, std::min(cparams.n_ubatch, chunk));
        const auto fresh = llama_kvp_alone(0, n_prompt, n_batch, n_split);
        if (!fresh.empty()) {
            r = std::min(r, fresh[0]);
        }
        while (r > 0 && llama_kvp_alone(r, n_prompt, n_batch, n_split) != fresh) {
            --r;
        }
    }

    if (r <= 0) {
        seq_rm_cur(0, -1); // the current sequence only
        return 0;
    }

    seq_rm_cur(r, -1);
    if (stage_schedule) {
        stage_schedule->forget(*this, 0, -1); // its decode history too (freeze's counts, the ladder's statistics):
    }                                         // a fresh prompt has none
    restart_budgets(n_prompt);
    if (st) {
        llama_kvp_obs_reset(st);
    }
    return (int32_t) r;
}
