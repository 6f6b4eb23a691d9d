// Fused autograd nodes for emulated FP16 on the CPU; built and loaded by adaloss/numerics/fused.py.
//
// Two nodes, each doing in C++ what a chain of Python autograd functions does otherwise:
//   * FusedGemm: a conv or linear layer whose weight, bias, output (and optionally input) are stored in
//     FP16, and whose backward pass rounds the incoming gradient to FP16, computes the input gradient from
//     that gradient scaled by a constant beta and stored in FP16 again (Algorithm 3's Backprop(beta * delta)),
//     and the weight gradient from the unscaled gradient, rounded to FP16 and multiplied by a constant
//     1/alpha. beta = inv_alpha = 1 is the plain emulated layer (any loss scaler); other values are the
//     adaptive scaler's layer on a step that reuses its scales; on a recompute step beta comes from
//     Algorithm 4 on the gradient (the rule in adaloss/adaptive/rules.py, arithmetic in _fast.c).
//   * FusedRescale: identity forward; backward brings the gradients of its outputs to one scale with
//     constant factors and, for one tensor with several consumers, sums them (Algorithm 5 with the
//     factors of the last recompute).
// FP16 rounding calls the kernel of _fast.c through a function pointer handed over by set_round_kernel,
// so one implementation of the rounding serves both modules; without it, torch's casts are used.
#include <torch/extension.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <vector>

using torch::autograd::AutogradContext;
using torch::autograd::Function;
using torch::autograd::variable_list;

namespace {

typedef void (*round_fn_t)(const float *, float *, int64_t, float, float);
typedef void (*round_scaled_fn_t)(const float *, float *, int64_t, float);
typedef void (*stats_fn_t)(const float *, float *, int64_t, int, float *);
typedef void (*wf_fn_t)(const float *const *, const int64_t *, const float *, const float *, int64_t, float *);
typedef float (*beta_fn_t)(const float *, const float *, int, float, float, float, float *);
typedef float (*maxabs_fn_t)(const float *, int64_t);
round_fn_t g_round = nullptr;
round_scaled_fn_t g_round_scaled = nullptr;
stats_fn_t g_stats = nullptr;
wf_fn_t g_wf = nullptr;
beta_fn_t g_beta = nullptr;
maxabs_fn_t g_maxabs = nullptr;

bool kernel_ok(const at::Tensor &t) {
    return g_round != nullptr && t.scalar_type() == at::kFloat && t.device().is_cpu() && t.is_contiguous();
}

// fp16(x * pre) * post, stored as x's dtype; written into x itself when `inplace`.
at::Tensor round16(const at::Tensor &x, double pre, double post, bool inplace) {
    if (kernel_ok(x)) {
        at::Tensor out = inplace ? x : at::empty_like(x, at::MemoryFormat::Contiguous);
        g_round(x.const_data_ptr<float>(), out.data_ptr<float>(), x.numel(), static_cast<float>(pre),
                static_cast<float>(post));
        return out;
    }
    at::Tensor v = pre == 1.0 ? x : x * pre;
    v = v.to(at::kHalf).to(x.scalar_type());
    if (post != 1.0) v.mul_(post);
    if (inplace) {
        x.copy_(v);
        return x;
    }
    return v;
}

// fp16(fp16(x) * scale): a gradient rounded to FP16, scaled by beta and stored in FP16 again (an overflow
// becomes infinity); written into x itself when `inplace`.
at::Tensor round16_scaled(const at::Tensor &x, double scale, bool inplace) {
    if (kernel_ok(x) && g_round_scaled != nullptr) {
        at::Tensor out = inplace ? x : at::empty_like(x, at::MemoryFormat::Contiguous);
        g_round_scaled(x.const_data_ptr<float>(), out.data_ptr<float>(), x.numel(), static_cast<float>(scale));
        return out;
    }
    at::Tensor v = (x.to(at::kHalf).to(x.scalar_type()) * scale).to(at::kHalf).to(x.scalar_type());
    if (inplace) {
        x.copy_(v);
        return x;
    }
    return v;
}

// Whether this backward call holds the only reference to `t` and its memory (no view, no other owner):
// then it may be overwritten in place, as autograd's own gradient accumulation does.
bool sole_owner(const at::Tensor &t) {
    return t.defined() && t.use_count() == 1 && !t.is_view() && t.storage().use_count() == 1 &&
           !t.requires_grad();
}

// The layer: kind 0 is a convolution (any dimension), 1 is linear. `packed` is what a backward call
// needs of it, kept in the autograd context as one integer list: kind, groups, the number of spatial
// dimensions d, then stride, padding, dilation and output_padding (d each).
struct GemmSpec {
    int64_t kind;
    std::vector<int64_t> stride, padding, dilation, output_padding;
    int64_t groups;
    std::vector<int64_t> packed;
};

struct FusedGemm : public Function<FusedGemm> {
    static at::Tensor forward(AutogradContext *ctx, const at::Tensor &x, const at::Tensor &w,
                              const std::optional<at::Tensor> &b, std::shared_ptr<GemmSpec> spec,
                              bool round_x, bool round_grad_x, double beta, double inv_alpha,
                              const std::optional<at::Tensor> &record, std::vector<int64_t> where,
                              std::vector<double> consts) {
        at::Tensor xr = round_x ? round16(x, 1.0, 1.0, false) : x;
        at::Tensor wr = round16(w, 1.0, 1.0, false);
        std::optional<at::Tensor> br;
        bool has_bias = b.has_value() && b->defined();
        if (has_bias) br = round16(*b, 1.0, 1.0, false);
        at::Tensor y;
        if (spec->kind == 0) {
            y = at::convolution(xr, wr, br, spec->stride, spec->padding, spec->dilation, false,
                                spec->output_padding, spec->groups);
        } else {
            y = at::linear(xr, wr, br);
        }
        y = round16(y, 1.0, 1.0, true);  // y is ours: rounded in place
        ctx->save_for_backward({xr, wr});
        ctx->saved_data["spec"] = spec->packed;
        // flags: round_grad_x, has_bias; scales: beta, 1 / alpha
        ctx->saved_data["flags"] = std::vector<int64_t>{round_grad_x, has_bias};
        ctx->saved_data["scales"] = std::vector<double>{beta, inv_alpha};
        if (record.has_value() && record->defined()) {  // a recompute pass: beta comes from the statistics
            ctx->saved_data["record"] = *record;
            ctx->saved_data["where"] = where;
            ctx->saved_data["consts"] = consts;
        }
        return y;
    }

    // `grads` by reference: the incoming gradient can be moved out, so that when nothing else holds it
    // it is rounded in place and its memory reused by the convolution's backward.
    static variable_list backward(AutogradContext *ctx, variable_list &grads) {
        // one per forward argument: x, w, b, spec, round_x, round_grad_x, beta, inv_alpha, record, where,
        // consts (all but the first three are not tensors needing a gradient)
        variable_list out(11);
        at::Tensor g = std::move(grads[0]);
        if (!g.defined()) return out;
        auto saved = ctx->get_saved_variables();
        const at::Tensor &xr = saved[0];
        const at::Tensor &wr = saved[1];
        if (ctx->saved_data.count("record")) {
            // Algorithm 4 on this gradient: round it and take its statistics in one pass, the weight's
            // factors in another, beta from both; the scale this layer received and the one it emits go
            // through the pass's record (see adaloss/adaptive/ops.py, AdaptiveState.arm_record).
            at::Tensor record = ctx->saved_data["record"].toTensor();
            auto where = ctx->saved_data["where"].toIntVector();  // in_slot, out_slot, beta_at, rule flags
            auto consts = ctx->saved_data["consts"].toDoubleVector();  // A, B, scale bound, accumulation bound
            double *rec = record.data_ptr<double>();
            double alpha_j = rec[where[0]];
            TORCH_CHECK(alpha_j == alpha_j, "adaptive loss scaling: no scale reached a layer; call "
                        "scaler.scale(loss).backward() on a model returned by scaler.attach()");
            if (!g.is_contiguous()) g = g.contiguous();
            at::Tensor v = sole_owner(g) ? g : at::empty_like(g);
            float stats[3], factors[3];
            g_stats(g.const_data_ptr<float>(), v.data_ptr<float>(), g.numel(), 1, stats);
            g = std::move(v);  // the rounded gradient, ours to overwrite
            return recompute_gradients(ctx, g, xr, wr, stats, factors, where, consts, rec, alpha_j, out);
        }
        // Constant scales (a reuse pass): beta goes into the gradient's rounding pass, fp16(fp16(g) * beta),
        // in place when nothing else holds the gradient; the weight gradient comes back by 1 / beta.
        auto scales = ctx->saved_data["scales"].toDoubleVector();
        const double beta = scales[0];
        const bool own = sole_owner(g) && kernel_ok(g);
        if (beta > 1.0 && ctx->needs_input_grad(0)) {
            g = round16_scaled(g, beta, own);
            return gemm_gradients(ctx, g, at::Tensor(), xr, wr, 1.0 / scales[1], beta, out);
        }
        g = round16(g, 1.0, 1.0, own);
        return gemm_gradients(ctx, g, at::Tensor(), xr, wr, 1.0 / scales[1], 1.0, out, beta);
    }

    // Algorithm 4 on host floats for the rounded gradient `g` (ours to overwrite) with its statistics,
    // then the gradients of Algorithm 3 with that beta.
    static variable_list recompute_gradients(AutogradContext *ctx, at::Tensor &g, const at::Tensor &xr,
                                             const at::Tensor &wr, float *stats, float *factors,
                                             const std::vector<int64_t> &where, const std::vector<double> &consts,
                                             double *rec, double alpha_j, variable_list &out) {
        at::Tensor wc = wr.contiguous();
        const float *wp = wc.const_data_ptr<float>();
        int64_t nw = wc.numel();
        // A sqrt(n_g) in double, rounded once (ScaleRule.lower_constant), as the Python paths do
        const float a = static_cast<float>(consts[0] * std::sqrt(static_cast<double>(g.numel())));
        const float b = static_cast<float>(consts[1]);
        g_wf(&wp, &nw, &a, &b, 1, factors);
        float beta_f;
        const double beta = g_beta(factors, stats, static_cast<int>(where[3]), static_cast<float>(consts[2]),
                                   static_cast<float>(consts[3]), static_cast<float>(alpha_j), &beta_f);
        rec[where[2]] = beta;
        rec[where[1]] = alpha_j * beta;
        if (beta > 1.0 && ctx->needs_input_grad(0)) {
            g = round16(g, beta, 1.0, kernel_ok(g));  // fp16(g * beta): g is already FP16-valued
            return gemm_gradients(ctx, g, at::Tensor(), xr, wr, alpha_j, beta, out);
        }
        return gemm_gradients(ctx, g, at::Tensor(), xr, wr, alpha_j, 1.0, out, beta);
    }

    // The input, weight and bias gradients (Algorithm 3) from the rounded incoming gradient `g`, which
    // already carries `g_scale` (beta when beta > 1, else 1): every product and sum of the convolution is
    // then scaled by exactly that power of two, so the weight and bias gradients are brought back by
    // 1 / g_scale in their FP16 rounding and divided by alpha_j (a multiplication for a power of two).
    // `beta_rest` is a beta still to apply to the input gradient's source (beta < 1, where the product
    // loses bits, so the weight gradient must come from the unscaled `g`: two tensors, two calls).
    static variable_list gemm_gradients(AutogradContext *ctx, at::Tensor &g, at::Tensor scaled,
                                        const at::Tensor &xr, const at::Tensor &wr, double alpha_j,
                                        double g_scale, variable_list &out, double beta_rest = 1.0) {
        auto flags = ctx->saved_data["flags"].toIntVector();
        bool round_grad_x = flags[0] != 0, has_bias = flags[1] != 0;
        bool need_x = ctx->needs_input_grad(0);
        bool need_w = ctx->needs_input_grad(1);
        bool need_b = has_bias && ctx->needs_input_grad(2);
        if (need_x && beta_rest != 1.0) scaled = round16(g, beta_rest, 1.0, false);  // fp16(g * beta), new
        const bool separate = scaled.defined();
        at::Tensor gx, gw, gb;
        auto spec = ctx->saved_data["spec"].toIntVector();
        if (spec[0] == 0) {
            const int64_t d = spec[2];
            auto part = [&](int64_t k) { return at::IntArrayRef(spec.data() + 3 + k * d, d); };
            auto conv_bw = [&](const at::Tensor &grad, std::array<bool, 3> mask) {
                return at::convolution_backward(grad, xr, wr, std::nullopt, part(0), part(1), part(2), false,
                                                part(3), spec[1], mask);
            };
            if (separate) {
                gx = std::get<0>(conv_bw(scaled, {true, false, false}));
                if (need_w || need_b) std::tie(std::ignore, gw, gb) = conv_bw(g, {false, need_w, need_b});
            } else {
                std::tie(gx, gw, gb) = conv_bw(g, {need_x, need_w, need_b});
            }
        } else {
            if (need_x) gx = (separate ? scaled : g).matmul(wr);
            if (need_w || need_b) {
                at::Tensor d2 = g.reshape({-1, g.size(-1)});
                if (need_w) gw = d2.t().matmul(xr.reshape({-1, xr.size(-1)}));
                if (need_b) gb = d2.sum(0);
            }
        }
        g.reset();
        scaled.reset();
        if (gx.defined() && round_grad_x) {
            gx = round16(gx, 1.0, 1.0, kernel_ok(gx) && !gx.is_view());
        }
        // Weight and bias gradients in FP16, then divided by the layer's alpha: for a power of two, by a
        // multiplication fused into the rounding (exact); otherwise by a division after it.
        int exp2;
        bool pow2 = alpha_j > 0 && std::isfinite(alpha_j) && std::frexp(alpha_j, &exp2) == 0.5;
        double post = pow2 ? 1.0 / alpha_j : 1.0, pre = 1.0 / g_scale;
        if (gw.defined()) {
            gw = round16(gw, pre, post, kernel_ok(gw) && !gw.is_view());
            if (!pow2) gw = gw.div_(alpha_j);
        }
        if (gb.defined()) {
            gb = round16(gb, pre, post, kernel_ok(gb) && !gb.is_view());
            if (!pow2) gb = gb.div_(alpha_j);
        }
        out[0] = gx;
        out[1] = gw;
        if (has_bias) out[2] = gb;
        return out;
    }
};

// Algorithm 5 on a branch point's incoming gradients `g` (undefined: no gradient from that consumer): the
// largest incoming alpha under which no rescaled gradient reaches u_max (else the smallest), with the
// Python version's double arithmetic; records the common alpha, the factors and the incoming alphas.
std::vector<double> algorithm5(AutogradContext *ctx, const std::vector<at::Tensor> &g) {
    at::Tensor record = ctx->saved_data["record"].toTensor();
    auto where = ctx->saved_data["where"].toIntVector();  // out_slot, common_at, factors_at, alphas_at, in_slots
    double u_max = ctx->saved_data["u_max"].toDouble();
    double *rec = record.data_ptr<double>();
    const size_t n = g.size();
    std::vector<double> alphas, maxima;
    std::vector<size_t> present;
    for (size_t i = 0; i < n; ++i) {
        if (!g[i].defined()) continue;
        double a = rec[where[4 + i]];
        TORCH_CHECK(a == a, "adaptive loss scaling: no scale reached a branch point; call "
                    "scaler.scale(loss).backward() on a model returned by scaler.attach()");
        at::Tensor c = g[i].is_contiguous() ? g[i] : g[i].contiguous();
        present.push_back(i);
        alphas.push_back(a);
        maxima.push_back(static_cast<double>(g_maxabs(c.const_data_ptr<float>(), c.numel())));
    }
    std::vector<double> factors(n, 1.0);
    if (present.empty()) return factors;
    bool found = false;
    double common = 0.0;
    for (double c : alphas) {
        bool ok = true;
        for (size_t k = 0; k < alphas.size() && ok; ++k) ok = (c / alphas[k]) * maxima[k] < u_max;
        if (ok && (!found || c > common)) {
            common = c;
            found = true;
        }
    }
    if (!found) {
        // paper: the smallest alpha (the step overflows and is skipped); reference (the authors' code): the
        // smallest alpha halved until the rescaled gradients fit, as adaloss/adaptive/rules.py computes it
        const double smallest = *std::min_element(alphas.begin(), alphas.end());
        common = smallest;
        if (ctx->saved_data["reference"].toBool()) {
            double m = 0.0;
            bool finite = true;
            for (size_t k = 0; k < alphas.size(); ++k) {
                double q = maxima[k] / alphas[k];
                if (!(q == q) || std::isinf(q)) finite = false;
                if (q > m) m = q;
            }
            if (finite) {
                double r = u_max / m, t = 0.0;
                if (r > 0 && std::isfinite(r)) {
                    int e;
                    std::frexp(r, &e);
                    t = std::ldexp(0.5, e);
                } else if (std::isinf(r)) {
                    t = r;
                }
                if (t * m >= u_max) t *= 0.5;
                t = std::min(t, smallest * 0.5);
                if (t > 0) common = t;
            }
        }
    }
    for (size_t k = 0; k < present.size(); ++k) factors[present[k]] = common / alphas[k];
    rec[where[0]] = common;
    rec[where[1]] = common;
    for (size_t i = 0; i < n; ++i) {
        rec[where[2] + i] = factors[i];
        rec[where[3] + i] = std::numeric_limits<double>::quiet_NaN();
    }
    for (size_t k = 0; k < present.size(); ++k) rec[where[3] + present[k]] = alphas[k];
    return factors;
}

struct FusedRescale : public Function<FusedRescale> {
    static variable_list forward(AutogradContext *ctx, at::TensorList xs, std::vector<double> factors,
                                 bool shared, const std::optional<at::Tensor> &record, std::vector<int64_t> where,
                                 double u_max, bool reference) {
        ctx->saved_data["factors"] = factors;
        ctx->saved_data["shared"] = shared;
        if (record.has_value() && record->defined()) {  // a recompute pass: Algorithm 5 on the gradients
            ctx->saved_data["record"] = *record;
            ctx->saved_data["where"] = where;
            ctx->saved_data["u_max"] = u_max;
            ctx->saved_data["reference"] = reference;
        }
        variable_list outs;
        outs.reserve(xs.size());
        for (const auto &x : xs) outs.push_back(x.view_as(x));
        return outs;
    }

    static variable_list backward(AutogradContext *ctx, variable_list &grads) {
        auto factors = ctx->saved_data["factors"].toDoubleVector();
        bool shared = ctx->saved_data["shared"].toBool();
        const size_t n = grads.size();
        variable_list out(n + 6);  // one per tensor input, then factors, shared, record, where, u_max, reference
        std::vector<at::Tensor> g(n);
        for (size_t i = 0; i < n; ++i) g[i] = std::move(grads[i]);
        if (ctx->saved_data.count("record")) factors = algorithm5(ctx, g);
        if (!shared) {  // several outputs of one op: each gradient rescaled on its own
            for (size_t i = 0; i < n; ++i) {
                if (!g[i].defined()) continue;
                if (factors[i] == 1.0) {
                    out[i] = g[i];
                } else if (sole_owner(g[i])) {
                    out[i] = g[i].mul_(factors[i]);
                } else {
                    out[i] = g[i] * factors[i];
                }
            }
            return out;
        }
        // One tensor, n consumers: sum the rescaled gradients (each factor is a power of two, so the
        // scaled term is exact and each fused add rounds once, as a separate multiply and add would).
        std::vector<size_t> present;
        for (size_t i = 0; i < n; ++i)
            if (g[i].defined()) present.push_back(i);
        if (present.empty()) return out;
        std::vector<size_t> order;
        int64_t owned = -1;
        for (size_t i : present) {
            if (sole_owner(g[i])) {
                owned = static_cast<int64_t>(i);
                break;
            }
        }
        if (owned >= 0) order.push_back(static_cast<size_t>(owned));
        for (size_t i : present)
            if (static_cast<int64_t>(i) != owned) order.push_back(i);
        at::Tensor total;
        bool fresh = false;
        size_t start = 0;
        if (owned >= 0) {
            total = g[owned];
            fresh = true;
            start = 1;
            double f = factors[owned];
            if (f != 1.0) {
                if (order.size() > 1 && factors[order[1]] == 1.0) {  // one pass: g[next] + f * total
                    at::add_out(total, g[order[1]], total, f);
                    start = 2;
                } else {
                    total.mul_(f);
                }
            }
        }
        for (size_t k = start; k < order.size(); ++k) {
            const at::Tensor &gi = g[order[k]];
            double f = factors[order[k]];
            if (!total.defined()) {
                if (f == 1.0) {
                    total = gi;
                    fresh = false;
                } else {
                    total = gi * f;
                    fresh = true;
                }
            } else if (fresh) {
                total.add_(gi, f);
            } else {
                total = at::add(total, gi, f);
                fresh = true;
            }
        }
        out[order[0]] = total;
        return out;
    }
};

at::Tensor gemm(const at::Tensor &x, const at::Tensor &w, const std::optional<at::Tensor> &b,
                std::shared_ptr<GemmSpec> spec, bool round_x, bool round_grad_x, double beta, double inv_alpha,
                const std::optional<at::Tensor> &record, std::vector<int64_t> where, std::vector<double> consts) {
    if (record.has_value()) {
        TORCH_CHECK(record->scalar_type() == at::kDouble && record->is_contiguous() && record->device().is_cpu(),
                    "gemm: the record must be a contiguous float64 CPU tensor");
        TORCH_CHECK(where.size() == 4 && consts.size() == 4, "gemm: where needs 4 entries and consts 4");
        for (int64_t i = 0; i < 3; ++i) TORCH_CHECK(0 <= where[i] && where[i] < record->numel(), "gemm: bad index");
    }
    return FusedGemm::apply(x, w, b, spec, round_x, round_grad_x, beta, inv_alpha, record, where, consts);
}

std::vector<at::Tensor> rescale(const std::vector<at::Tensor> &xs, std::vector<double> factors, bool shared,
                                const std::optional<at::Tensor> &record, std::vector<int64_t> where,
                                double u_max, bool reference) {
    TORCH_CHECK(factors.size() == xs.size(), "rescale: one factor per input");
    if (record.has_value()) {
        TORCH_CHECK(record->scalar_type() == at::kDouble && record->is_contiguous() && record->device().is_cpu(),
                    "rescale: the record must be a contiguous float64 CPU tensor");
        TORCH_CHECK(where.size() == 4 + xs.size(), "rescale: where needs 4 entries plus one slot per input");
        int64_t top = record->numel();
        TORCH_CHECK(where[2] + static_cast<int64_t>(xs.size()) <= top && where[3] + static_cast<int64_t>(xs.size()) <= top,
                    "rescale: bad index");
        for (size_t i = 0; i < where.size(); ++i) TORCH_CHECK(0 <= where[i] && where[i] < top, "rescale: bad index");
    }
    return FusedRescale::apply(at::TensorList(xs), factors, shared, record, where, u_max, reference);
}

void set_kernels(uintptr_t round, uintptr_t round_scaled, uintptr_t stats, uintptr_t wf, uintptr_t beta,
                 uintptr_t maxabs) {
    g_round = reinterpret_cast<round_fn_t>(round);
    g_round_scaled = reinterpret_cast<round_scaled_fn_t>(round_scaled);
    g_stats = reinterpret_cast<stats_fn_t>(stats);
    g_wf = reinterpret_cast<wf_fn_t>(wf);
    g_beta = reinterpret_cast<beta_fn_t>(beta);
    g_maxabs = reinterpret_cast<maxabs_fn_t>(maxabs);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.attr("ABI") = 4;
    pybind11::class_<GemmSpec, std::shared_ptr<GemmSpec>>(m, "GemmSpec")
        .def(pybind11::init([](int64_t kind, std::vector<int64_t> stride, std::vector<int64_t> padding,
                               std::vector<int64_t> dilation, std::vector<int64_t> output_padding,
                               int64_t groups) {
                 const size_t d = stride.size();
                 TORCH_CHECK(padding.size() == d && dilation.size() == d && output_padding.size() == d,
                             "GemmSpec: stride, padding, dilation and output_padding need the same length");
                 std::vector<int64_t> packed{kind, groups, static_cast<int64_t>(d)};
                 for (const auto *v : {&stride, &padding, &dilation, &output_padding})
                     packed.insert(packed.end(), v->begin(), v->end());
                 return std::make_shared<GemmSpec>(
                     GemmSpec{kind, stride, padding, dilation, output_padding, groups, packed});
             }),
             pybind11::arg("kind"), pybind11::arg("stride"), pybind11::arg("padding"), pybind11::arg("dilation"),
             pybind11::arg("output_padding"), pybind11::arg("groups"));
    m.def("gemm", &gemm, "conv/linear with FP16 storage; backward scales delta by beta and grad W by 1/alpha",
          pybind11::arg("x"), pybind11::arg("w"), pybind11::arg("b"), pybind11::arg("spec"), pybind11::arg("round_x"),
          pybind11::arg("round_grad_x"), pybind11::arg("beta") = 1.0, pybind11::arg("inv_alpha") = 1.0,
          pybind11::arg("record") = pybind11::none(), pybind11::arg("where") = std::vector<int64_t>{},
          pybind11::arg("consts") = std::vector<double>{});
    m.def("rescale", &rescale, "identity; backward rescales (and, if shared, sums) the gradients",
          pybind11::arg("xs"), pybind11::arg("factors"), pybind11::arg("shared"),
          pybind11::arg("record") = pybind11::none(), pybind11::arg("where") = std::vector<int64_t>{},
          pybind11::arg("u_max") = 0.0, pybind11::arg("reference") = false);
    m.def("set_kernels", &set_kernels,
          "addresses of the _fast.c kernels: round, round scaled, stats, weight factors, beta, max");
}
