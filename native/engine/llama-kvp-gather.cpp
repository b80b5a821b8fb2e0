// llama-kvp-gather.cpp - many small reads of tensors in device memory as one transfer.
//
// The host work between two decode steps reads pieces of every layer's tensors: summarise's leavers (K and V rows of
// each layer's cache), the observation's rows. Each ggml_backend_tensor_get from device memory is a round trip (a
// copy and a synchronisation on a GPU, a request over RPC), so 30 layers x a few pieces cost more than the bytes. A
// gather collects the pieces, then one small graph on the pieces' device copies them into one staging tensor there
// (get_rows for cache rows, dequantized to f32; a copy for f32 ranges), and the staging tensor is read at once: one
// upload of the row indices, one graph, one read. Pieces in host memory are read in place, as before, so the CPU path
// is unchanged.

#include "llama-kvp-impl.h"
#include "llama-kvp-memory.h"

#include "ggml-alloc.h"

#include <algorithm>
#include <cstring>
#include <map>

// a backend of each device that gathers ran on, with its graph allocator (kept for the context's life: a CUDA or RPC
// backend is costly to create)
struct llama_kvp_gather_state {
    struct dev_state {
        ggml_backend_t backend = nullptr;
        ggml_gallocr_t galloc  = nullptr;
    };
    std::map<ggml_backend_dev_t, dev_state> devs;

    ~llama_kvp_gather_state() {
        for (auto & [dev, d] : devs) {
            if (d.galloc) {
                ggml_gallocr_free(d.galloc);
            }
            if (d.backend) {
                ggml_backend_free(d.backend);
            }
        }
    }
};

void llama_kvp_gather_state_deleter::operator()(llama_kvp_gather_state * s) const {
    delete s;
}

static bool llama_kvp_in_host(const ggml_tensor * t) {
    return t->buffer && ggml_backend_buffer_is_host(t->buffer);
}

// a piece read the plain way: a few transfers of its own (a device without a backend to gather, an op it lacks)
static void llama_kvp_gather_plain(const llama_kvp_gather::piece & p) {
    if (p.idx.empty()) {
        ggml_backend_tensor_get(p.t, p.out, p.off*sizeof(float), p.n*sizeof(float));
        return;
    }
    const size_t nb = llama_kvp_cell_bytes(p.t, p.trans);
    std::vector<uint8_t> raw(p.idx.size()*nb);
    llama_kvp_cells_read(p.t, p.trans, p.size, p.idx, raw.data());
    for (size_t i = 0; i < p.idx.size(); ++i) {
        llama_kvp_row_to_f32(p.t->type, raw.data() + i*nb, p.out + i*p.t->ne[0], p.t->ne[0]);
    }
}

void llama_kvp_gather::add_rows(ggml_tensor * t, bool trans, uint32_t size, const std::vector<uint32_t> & idx, float * out) {
    if (idx.empty()) {
        return;
    }
    piece p = { t, trans, size, idx, 0, idx.size()*(size_t) t->ne[0], out };
    if (llama_kvp_in_host(t)) { // in place, as f32
        llama_kvp_gather_plain(p);
        return;
    }
    pieces.push_back(std::move(p));
}

void llama_kvp_gather::add_f32(ggml_tensor * t, size_t off, size_t n, float * out) {
    GGML_ASSERT(t->type == GGML_TYPE_F32 && (off + n)*sizeof(float) <= ggml_nbytes(t));
    if (n == 0) {
        return;
    }
    if (llama_kvp_in_host(t)) {
        memcpy(out, (const float *) t->data + off, n*sizeof(float));
        return;
    }
    piece p = { t, false, 0, {}, off, n, out };
    pieces.push_back(std::move(p));
}

// the pieces of one device: one graph into one staging tensor; false (nothing read) if the device cannot run it
static bool llama_kvp_gather_dev(llama_kvp_gather_state::dev_state & d, const std::vector<const llama_kvp_gather::piece *> & ps) {
    size_t n_ids   = 0;
    size_t n_total = 0;
    for (const auto * p : ps) {
        n_ids   += p->trans ? p->n : p->idx.size();
        n_total += p->n;
    }
    const size_t n_tensors = 12*ps.size() + 8;
    ggml_init_params params = { n_tensors*ggml_tensor_overhead() + ggml_graph_overhead_custom(n_tensors, false), nullptr, true };
    ggml_context_ptr ctx(ggml_init(params));
    if (!ctx) {
        return false;
    }
    ggml_context * c = ctx.get();
    ggml_cgraph * gf = ggml_new_graph_custom(c, n_tensors, false);

    ggml_tensor * idx_all = ggml_new_tensor_1d(c, GGML_TYPE_I32, std::max<size_t>(n_ids, 1));
    ggml_tensor * staging = ggml_new_tensor_1d(c, GGML_TYPE_F32, n_total);
    ggml_set_input(idx_all);
    ggml_set_output(staging);

    // each piece's copy into its part of the staging tensor; a piece whose ops the device lacks (get_rows of some
    // quantized types) is read the plain way instead
    std::vector<const llama_kvp_gather::piece *> in_graph;
    std::vector<int32_t> ids;
    size_t i_out = 0;
    for (const auto * p : ps) {
        ggml_tensor * t = p->t;
        ggml_tensor * src;
        bool ok = true;
        if (p->idx.empty()) {
            src = ggml_view_1d(c, t, p->n, p->off*sizeof(float));
        } else {
            // a row per cell; in a transposed V (element e of cell i at e*size + i) a row per element, its ids
            // cell by cell, so that the result is rows of cells all the same (a copy of the whole tensor made
            // contiguous first costs more than the leavers: ~8 ms a step over RPC)
            const int64_t ne0    = t->ne[0];
            const size_t  n_read = p->trans ? p->idx.size()*(size_t) ne0 : p->idx.size();
            ggml_tensor * rows_of = p->trans
                ? ggml_view_2d(c, t, 1, (int64_t) p->size*ne0, ggml_type_size(t->type), 0)
                : ggml_view_2d(c, t, ne0, p->size, t->nb[1], 0);
            ggml_tensor * ids_view = ggml_view_1d(c, idx_all, n_read, ids.size()*sizeof(int32_t));
            src = ggml_get_rows(c, rows_of, ids_view); // f32 [ne0, n] or [1, n*ne0]
            ok = ggml_backend_supports_op(d.backend, src);
            if (ok && p->trans) {
                for (uint32_t i : p->idx) {
                    for (int64_t e = 0; e < ne0; ++e) {
                        ids.push_back((int32_t) (e*p->size + i));
                    }
                }
            } else if (ok) {
                ids.insert(ids.end(), p->idx.begin(), p->idx.end());
            }
            src = ggml_reshape_1d(c, src, p->n);
        }
        ggml_tensor * dst = ggml_cpy(c, src, ggml_view_1d(c, staging, p->n, i_out*sizeof(float)));
        if (!ok || !ggml_backend_supports_op(d.backend, dst)) {
            llama_kvp_gather_plain(*p);
            continue;
        }
        ggml_build_forward_expand(gf, dst);
        in_graph.push_back(p);
        i_out += p->n;
    }
    if (in_graph.empty()) {
        return true;
    }
    if (!ggml_gallocr_alloc_graph(d.galloc, gf)) {
        return false; // no device memory for it: the pieces are read the plain way
    }
    if (!ids.empty()) {
        ggml_backend_tensor_set(idx_all, ids.data(), 0, ids.size()*sizeof(int32_t));
    }
    if (ggml_backend_graph_compute(d.backend, gf) != GGML_STATUS_SUCCESS) {
        return false;
    }
    std::vector<float> host(i_out);
    ggml_backend_tensor_get(staging, host.data(), 0, i_out*sizeof(float));
    i_out = 0;
    for (const auto * p : in_graph) {
        std::copy_n(host.data() + i_out, p->n, p->out);
        i_out += p->n;
    }
    return true;
}

void llama_kvp_gather::run(llama_kvp_context * st) {
    if (pieces.empty()) {
        return;
    }
    if (!st) { // no context to gather with
        for (const auto & p : pieces) {
            llama_kvp_gather_plain(p);
        }
        pieces.clear();
        return;
    }
    llama_kvp_sync(st); // the context's graphs have written what is read
    if (!st->gather) {
        st->gather.reset(new llama_kvp_gather_state());
    }
    std::map<ggml_backend_dev_t, std::vector<const piece *>> by_dev;
    for (const auto & p : pieces) {
        by_dev[ggml_backend_buft_get_device(ggml_backend_buffer_get_type(p.t->buffer))].push_back(&p);
    }
    for (auto & [dev, ps] : by_dev) {
        auto & d = st->gather->devs[dev];
        if (!d.backend && dev) {
            d.backend = ggml_backend_dev_init(dev, nullptr);
            d.galloc  = d.backend ? ggml_gallocr_new(ggml_backend_get_default_buffer_type(d.backend)) : nullptr;
        }
        // no backend to gather with, or a graph it cannot run: each piece on its own (a piece read already is read
        // again, with the same bytes)
        if (!d.backend || !d.galloc || !llama_kvp_gather_dev(d, ps)) {
            for (const auto * p : ps) {
                llama_kvp_gather_plain(*p);
            }
        }
    }
    pieces.clear();
}
