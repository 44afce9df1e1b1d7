// cuDNN fused attention (SDPA) for vime's packed variable-length causal attention: the host side
// that builds, caches and runs cuDNN graphs through the cuDNN frontend (header-only C++, MIT;
// built with NV_CUDNN_FRONTEND_USE_DYNAMIC_LOADING, so libcudnn and libcudart are dlopen'ed at
// first use and the binary links neither).
//
// Layouts (kernels/src/cudnn.rs picks one per call):
//   ragged (layout 0): every tensor a THD ragged tensor over the token axis,
//     q, o, dq, do: [T_q, H_q, D] -> dims [B, H_q, S_q, D], strides [S_q*H_q*D, D, H_q*D, 1]
//     k, v, dk, dv: [T_k, H_k, D] -> dims [B, H_k, S_k, D], strides [S_k*H_k*D, D, H_k*D, 1]
//     stats (f32 log-sum-exp of the scaled scores): [T_q, H_q] -> dims [B, H_q, S_q, 1],
//       strides [S_q*H_q, 1, H_q, 1]
//     with ragged offsets (in elements) cu_q[b]*H_q*D, cu_k[b]*H_k*D, cu_q[b]*H_q, and the padding
//     mask's per-sequence lengths; S_q, S_k and B are rounded-up bounds (empty sequences pad B).
//   dense (layout 1): every sequence exactly S_q = S_k long, the same views without offsets or
//     padding mask, and stats packed [B, H_q, S_q, 1].
// The causal mask is top-left (all L_q = L_k) or bottom-right (queries at the end of their keys,
// vime's varlen convention for L_k > L_q).
//
// One graph per (direction, shape, scale, determinism, device), built once and cached; the
// caller owns every buffer, including the workspace, whose size it asks for first.
#include <cudnn_frontend.h>
#include <dlfcn.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <unordered_map>

namespace fe = cudnn_frontend;

// The frontend's dynamic-loading mode resolves every cuDNN symbol through this handle, which the
// application opens (see load_cudnn).
namespace cudnn_frontend {
void* cudnn_dlhandle = nullptr;
}

extern "C" {
// Mirrors `SdpaArgs` in kernels/src/cudnn.rs.
struct VimeSdpaArgs {
    int32_t backward;       // 0: forward (o, stats), 1: backward (dq, dk, dv)
    int32_t deterministic;  // backward only
    int32_t device;         // CUDA ordinal (graph and handle cache key)
    int32_t layout;         // 0: ragged (THD + padding mask), 1: dense (every sequence s_q = s_k long)
    int64_t b, s_q, s_k, h_q, h_k, d, t_q, t_k;
    float scale;
    int32_t top_left;  // causal mask top-left aligned (every sequence has L_q = L_k), else bottom-right
    void* stream;
    void *q, *k, *v, *o, *stats, *dout, *dq, *dk, *dv;
    void *seq_len_q, *seq_len_k;           // int32 [b]
    void *off_q, *off_k, *off_stats;       // int32 [b + 1], in elements
    void* workspace;
    int64_t workspace_bytes;
    int32_t plan;  // -1: heuristics mode A's first choice; k >= 0: the k-th of modes A + B's list
};
}

namespace {

enum Uid : int64_t {
    Q = 1, K, V, O, STATS, DO, DQ, DK, DV, SEQ_Q, SEQ_K, OFF_Q, OFF_K, OFF_STATS
};

using Key = std::tuple<int, int, int, int, int, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                       uint32_t, int>;

struct Entry {
    std::shared_ptr<fe::graph::Graph> graph;
    int64_t workspace = 0;
};

std::mutex g_mutex;
std::map<Key, Entry> g_graphs;
std::map<int, cudnnHandle_t> g_handles;
int64_t g_built = 0;         // graphs built so far
double g_build_seconds = 0;  // host time spent building them

void set_err(char* err, size_t n, const std::string& msg) {
    if (err && n) {
        std::strncpy(err, msg.c_str(), n - 1);
        err[n - 1] = 0;
    }
}

Key key_of(const VimeSdpaArgs& a) {
    uint32_t scale_bits;
    std::memcpy(&scale_bits, &a.scale, 4);
    return Key{a.backward, a.backward ? a.deterministic : 0, a.device, a.layout, a.top_left, a.b, a.s_q, a.s_k,
               a.h_q, a.h_k, a.d, a.t_q, a.t_k, scale_bits, a.plan};
}

std::shared_ptr<fe::graph::Tensor_attributes> index_tensor(fe::graph::Graph& g, const char* name, int64_t uid,
                                                           int64_t n) {
    return g.tensor(fe::graph::Tensor_attributes()
                        .set_name(name)
                        .set_uid(uid)
                        .set_dim({n, 1, 1, 1})
                        .set_stride({1, 1, 1, 1})
                        .set_data_type(fe::DataType_t::INT32));
}

// A ragged [B, H, S, D] view of a packed [T, H, D] tensor.
// (Dense layout: `off` null, and the view is exact since every sequence is `s` long.)
fe::graph::Tensor_attributes thd(const char* name, int64_t uid, int64_t b, int64_t h, int64_t s, int64_t d,
                                 std::shared_ptr<fe::graph::Tensor_attributes> off) {
    auto t = fe::graph::Tensor_attributes()
                 .set_name(name)
                 .set_uid(uid)
                 .set_dim({b, h, s, d})
                 .set_stride({s * h * d, d, h * d, 1});
    if (off) t.set_ragged_offset(off);
    return t;
}

void set_thd(const std::shared_ptr<fe::graph::Tensor_attributes>& t, const char* name, int64_t uid, int64_t b,
             int64_t h, int64_t s, int64_t d, std::shared_ptr<fe::graph::Tensor_attributes> off) {
    t->set_output(true).set_name(name).set_uid(uid).set_dim({b, h, s, d}).set_stride({s * h * d, d, h * d, 1});
    if (off) t->set_ragged_offset(off);
}

// Ragged: [T, H] token-major. Dense: packed [B, H, S] (the only non-ragged stats layout whose
// backward read cuDNN before 9.26 honours).
void set_stats(const std::shared_ptr<fe::graph::Tensor_attributes>& t, int64_t b, int64_t h, int64_t s,
               std::shared_ptr<fe::graph::Tensor_attributes> off) {
    t->set_name("stats").set_uid(STATS).set_dim({b, h, s, 1}).set_data_type(fe::DataType_t::FLOAT);
    if (off) {
        t->set_stride({s * h, 1, h, 1}).set_ragged_offset(off);
    } else {
        t->set_stride({h * s, s, 1, 1});
    }
}

// The causal mask and, on the ragged layout, the padding mask of either direction's attributes.
template <class Opts>
void set_masks(Opts& opts, const VimeSdpaArgs& a, std::shared_ptr<fe::graph::Tensor_attributes> seq_q,
               std::shared_ptr<fe::graph::Tensor_attributes> seq_k) {
    if (a.top_left) {
        opts.set_causal_mask(true);
    } else {
        opts.set_causal_mask_bottom_right(true);
    }
    if (a.layout == 0) {
        opts.set_padding_mask(true)
            .set_seq_len_q(seq_q)
            .set_seq_len_kv(seq_k)
            .set_max_total_seq_len_q(a.t_q)
            .set_max_total_seq_len_kv(a.t_k);
    }
}

std::string build(const VimeSdpaArgs& a, cudnnHandle_t handle, Entry& out) {
    auto g = std::make_shared<fe::graph::Graph>();
    g->set_io_data_type(fe::DataType_t::BFLOAT16)
        .set_intermediate_data_type(fe::DataType_t::FLOAT)
        .set_compute_data_type(fe::DataType_t::FLOAT);
    const bool ragged = a.layout == 0;
    std::shared_ptr<fe::graph::Tensor_attributes> off_q, off_k, off_s, seq_q, seq_k;
    if (ragged) {
        off_q = index_tensor(*g, "off_q", OFF_Q, a.b + 1);
        off_k = index_tensor(*g, "off_k", OFF_K, a.b + 1);
        off_s = index_tensor(*g, "off_stats", OFF_STATS, a.b + 1);
        seq_q = index_tensor(*g, "seq_len_q", SEQ_Q, a.b);
        seq_k = index_tensor(*g, "seq_len_k", SEQ_K, a.b);
    }
    auto q = g->tensor(thd("q", Q, a.b, a.h_q, a.s_q, a.d, off_q));
    auto k = g->tensor(thd("k", K, a.b, a.h_k, a.s_k, a.d, off_k));
    auto v = g->tensor(thd("v", V, a.b, a.h_k, a.s_k, a.d, off_k));
    if (!a.backward) {
        auto opts = fe::graph::SDPA_attributes().set_name("vime_sdpa").set_generate_stats(true).set_attn_scale(a.scale);
        set_masks(opts, a, seq_q, seq_k);
        auto [o, stats] = g->sdpa(q, k, v, opts);
        set_thd(o, "o", O, a.b, a.h_q, a.s_q, a.d, off_q);
        stats->set_output(true);
        set_stats(stats, a.b, a.h_q, a.s_q, off_s);
    } else {
        auto o = g->tensor(thd("o", O, a.b, a.h_q, a.s_q, a.d, off_q));
        auto dout = g->tensor(thd("dout", DO, a.b, a.h_q, a.s_q, a.d, off_q));
        auto stats = g->tensor(fe::graph::Tensor_attributes());
        set_stats(stats, a.b, a.h_q, a.s_q, off_s);
        auto opts = fe::graph::SDPA_backward_attributes()
                        .set_name("vime_sdpa_backward")
                        .set_attn_scale(a.scale)
                        .set_deterministic_algorithm(a.deterministic != 0);
        set_masks(opts, a, seq_q, seq_k);
        auto [dq, dk, dv] = g->sdpa_backward(q, k, v, o, dout, stats, opts);
        set_thd(dq, "dq", DQ, a.b, a.h_q, a.s_q, a.d, off_q);
        set_thd(dk, "dk", DK, a.b, a.h_k, a.s_k, a.d, off_k);
        set_thd(dv, "dv", DV, a.b, a.h_k, a.s_k, a.d, off_k);
    }
    fe::error_t st = g->validate();
    if (st.is_good()) st = g->build_operation_graph(handle);
    if (a.plan < 0) {
        if (st.is_good()) st = g->create_execution_plans({fe::HeurMode_t::A});
        if (st.is_good()) st = g->check_support(handle);
        if (st.is_good()) st = g->build_plans(handle);
    } else {
        // A chosen plan (measurement): the k-th engine config of heuristics modes A and B, listed
        // on stderr with their names so that a run can say which kernel each index is.
        if (st.is_good()) st = g->create_execution_plans({fe::HeurMode_t::A, fe::HeurMode_t::B});
        if (st.is_good()) st = g->check_support(handle);
        if (st.is_good()) {
            const int64_t n = g->get_execution_plan_count();
            for (int64_t i = 0; i < n; ++i) {
                std::string name;
                g->get_plan_name_at_index(i, name);
                std::fprintf(stderr, "cuDNN SDPA %s plan %lld of %lld: %s\n", a.backward ? "backward" : "forward",
                             (long long)i, (long long)n, name.c_str());
            }
            if (a.plan >= n) {
                return "plan " + std::to_string(a.plan) + " asked for, the heuristics list " + std::to_string(n);
            }
            st = g->build_plan_at_index(a.plan);
        }
    }
    if (!st.is_good()) return st.get_message().empty() ? std::string("cuDNN graph build failed") : st.get_message();
    int64_t ws = 0;
    st = a.plan < 0 ? g->get_workspace_size(ws) : g->get_workspace_size_plan_at_index(a.plan, ws);
    if (!st.is_good()) return st.get_message();
    out.graph = g;
    out.workspace = ws;
    return "";
}

// Opens libcudnn once ($VIME_CUDNN_LIB, default libcudnn.so.9 on the loader's path).
bool load_cudnn(char* err, size_t n) {
    if (fe::cudnn_dlhandle) return true;
    const char* env = std::getenv("VIME_CUDNN_LIB");
    const char* lib = (env && *env) ? env : "libcudnn.so.9";
    fe::cudnn_dlhandle = dlopen(lib, RTLD_NOW | RTLD_GLOBAL);
    if (!fe::cudnn_dlhandle) {
        const char* why = dlerror();
        set_err(err, n, std::string("cannot load ") + lib + " (cuDNN 9; put its lib/ folder on LD_LIBRARY_PATH or set VIME_CUDNN_LIB): " +
                            (why ? why : "unknown dlopen error"));
        return false;
    }
    return true;
}

// The cached graph for `a` (built on first use); null with `err` set on failure.
Entry* entry_for(const VimeSdpaArgs& a, cudnnHandle_t* handle_out, char* err, size_t n) {
    if (!load_cudnn(err, n)) return nullptr;
    auto h = g_handles.find(a.device);
    if (h == g_handles.end()) {
        cudnnHandle_t handle = nullptr;
        cudnnStatus_t s = fe::detail::create_handle(&handle);
        if (s != CUDNN_STATUS_SUCCESS) {
            set_err(err, n, std::string("cudnnCreate failed: ") + fe::detail::get_error_string(s));
            return nullptr;
        }
        h = g_handles.emplace(a.device, handle).first;
    }
    *handle_out = h->second;
    auto key = key_of(a);
    auto it = g_graphs.find(key);
    if (it == g_graphs.end()) {
        Entry e;
        auto t0 = std::chrono::steady_clock::now();
        std::string msg = build(a, h->second, e);
        g_build_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        g_built += 1;
        if (!msg.empty()) {
            set_err(err, n, msg);
            return nullptr;
        }
        it = g_graphs.emplace(key, e).first;
    }
    return &it->second;
}

}  // namespace

extern "C" {

// How many graphs were built so far and the host seconds that took.
void vime_cudnn_graph_stats(int64_t* built, double* seconds) {
    std::lock_guard<std::mutex> lock(g_mutex);
    *built = g_built;
    *seconds = g_build_seconds;
}

// The loaded cuDNN's version (major * 10000 + minor * 100 + patch), 0 before the first load.
int64_t vime_cudnn_backend_version() {
    try {
        std::lock_guard<std::mutex> lock(g_mutex);
        return fe::cudnn_dlhandle ? static_cast<int64_t>(fe::detail::get_backend_version()) : 0;
    } catch (...) {
        return 0;
    }
}

// Builds (or finds) the graph for `a` and reports its workspace size. 0 on success.
int vime_cudnn_sdpa_workspace(const VimeSdpaArgs* a, int64_t* bytes, char* err, size_t n) {
    try {
        std::lock_guard<std::mutex> lock(g_mutex);
        cudnnHandle_t handle;
        Entry* e = entry_for(*a, &handle, err, n);
        if (!e) return 1;
        *bytes = e->workspace;
        return 0;
    } catch (const std::exception& ex) {
        set_err(err, n, ex.what());
        return 2;
    }
}

// Runs the graph for `a` on `a->stream` (asynchronously). 0 on success.
int vime_cudnn_sdpa_run(const VimeSdpaArgs* a, char* err, size_t n) {
    try {
        std::lock_guard<std::mutex> lock(g_mutex);
        cudnnHandle_t handle;
        Entry* e = entry_for(*a, &handle, err, n);
        if (!e) return 1;
        if (a->workspace_bytes < e->workspace) {
            set_err(err, n, "workspace of " + std::to_string(a->workspace_bytes) + " bytes, the graph needs " +
                                std::to_string(e->workspace));
            return 3;
        }
        cudnnStatus_t s = fe::detail::set_stream(handle, static_cast<cudaStream_t>(a->stream));
        if (s != CUDNN_STATUS_SUCCESS) {
            set_err(err, n, std::string("cudnnSetStream failed: ") + fe::detail::get_error_string(s));
            return 4;
        }
        std::unordered_map<int64_t, void*> pack = {{Q, a->q}, {K, a->k}, {V, a->v}, {O, a->o}, {STATS, a->stats}};
        if (a->layout == 0) {
            pack[SEQ_Q] = a->seq_len_q;
            pack[SEQ_K] = a->seq_len_k;
            pack[OFF_Q] = a->off_q;
            pack[OFF_K] = a->off_k;
            pack[OFF_STATS] = a->off_stats;
        }
        if (a->backward) {
            pack[DO] = a->dout;
            pack[DQ] = a->dq;
            pack[DK] = a->dk;
            pack[DV] = a->dv;
        }
        // The plan is part of the graph's key, so this entry was built for a->plan.
        fe::error_t st = a->plan < 0 ? e->graph->execute(handle, pack, a->workspace)
                                      : e->graph->execute_plan_at_index(handle, pack, a->workspace, a->plan);
        if (!st.is_good()) {
            set_err(err, n, st.get_message());
            return 5;
        }
        return 0;
    } catch (const std::exception& ex) {
        set_err(err, n, ex.what());
        return 2;
    }
}

}  // extern "C"
