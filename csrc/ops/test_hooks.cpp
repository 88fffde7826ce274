// kt_ops._C._testing: hooks for tests and benchmarks, kept out of the runtime
// controls of kt_ops._C (python_bindings.cpp). Nothing in kt_ops/ calls them;
// tests/ and benchmarks/ reach internals through them (the pool's task
// placement, the caller's move target, one tier's quantizer, fp8 decode, fp32 NT tiles or
// LoRA products).
// The other hooks of this submodule are registered beside the code they
// expose: HostBridge and bridge_caller_waits (csrc/hybrid/host_transport.cpp),
// split_blocks (csrc/ops/numa_bindings.cpp).
#include <ATen/ATen.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <sched.h>
#include <torch/csrc/utils/pybind.h>  // at::Tensor <-> torch.Tensor casters

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "formats/q8_activations.h"
#include "kernels/brgemm.h"
#include "kernels/dispatch.h"
#include "kernels/tiers.h"
#include "moe/lora_products.h"
#include "moe/moe_forward.h"
#include "runtime/aligned_vector.h"
#include "runtime/cpu_features.h"
#include "runtime/openmp_team.h"
#include "runtime/thread_pool.h"

namespace py = pybind11;

namespace kt::ops {

void register_test_hooks(py::module& t) {
  using kt::kernels::Isa;
  t.def(
      "set_brgemm_bf16_pairs",
      [](bool on) {
        const bool before = kt::kernels::brgemm::bf16_pairs();
        kt::kernels::brgemm::set_bf16_pairs(on);
        return before;
      },
      py::arg("on"),
      "Whether oneDNN's bf16 kernel multiplies 16-row blocks in pairs (one N = 32 call; "
      "kernels/brgemm.h, bf16_pairs); returns the previous setting.");
  t.def("set_stream_bytes", &kt::moe::set_stream_bytes, py::arg("bytes"),
        "Size (bytes) from which the forward writes its per-slot outputs and saved "
        "pre-activations with non-temporal stores (moe/moe_forward.h); returns the previous.");
  t.def(
      "parallel_probe",
      [](int64_t tasks, int64_t fail_at, bool caller_waits, bool pool_threads) {
        // Runs `tasks` pool tasks; each reports (thread index, whether it ran
        // inside an OpenMP region). Task fail_at (if >= 0) throws instead.
        // caller_waits / pool_threads: as a CUDA bridge host callback runs its jobs.
        std::vector<std::pair<int, bool>> out(static_cast<size_t>(std::max<int64_t>(tasks, 0)));
        py::gil_scoped_release no_gil;
        std::optional<kt::runtime::PoolThreadsScope> pool_scope;
        if (pool_threads) pool_scope.emplace();
        kt::runtime::CallerWaitsScope waits(caller_waits);
        kt::runtime::ThreadPool::global().run(tasks, [&](int64_t task, int thread) {
          if (task == fail_at)
            throw std::runtime_error("kt_ops._C._testing.parallel_probe: task " +
                                     std::to_string(task));
          out[static_cast<size_t>(task)] = {thread, kt::runtime::openmp::in_parallel()};
        });
        return out;
      },
      py::arg("tasks"), py::arg("fail_at") = -1, py::arg("caller_waits") = false,
      py::arg("pool_threads") = false);
  t.def("parallel_probe_cpus", [](int64_t tasks, int64_t spin_us) {
    // Runs `tasks` pool tasks of `spin_us` microseconds each; each reports
    // (thread index, the CPU it started on).
    std::vector<std::pair<int, int>> out(static_cast<size_t>(std::max<int64_t>(tasks, 0)));
    py::gil_scoped_release no_gil;
    kt::runtime::ThreadPool::global().run(tasks, [&](int64_t task, int thread) {
      out[static_cast<size_t>(task)] = {thread, sched_getcpu()};
      const auto end = std::chrono::steady_clock::now() + std::chrono::microseconds(spin_us);
      while (std::chrono::steady_clock::now() < end) {
      }
    });
    return out;
  });
  // Where the pool moves a caller on `cpu` with affinity `mask` (runtime/thread_pool.h).
  t.def("caller_target", &kt::runtime::detail::caller_target);
  // The q8 record of one fp32 row (len a multiple of 32) from tier `isa`'s
  // quantizer (formats/q8_activations.h).
  t.def("quantize_row_q8", [](const std::vector<float>& x, const std::string& isa_name) {
    const Isa isa = kt::kernels::parse_isa(isa_name);
    const std::vector<Isa> ok = kt::kernels::supported_isas();
    if (std::find(ok.begin(), ok.end(), isa) == ok.end())
      throw py::value_error("quantize_row_q8: ISA '" + isa_name + "' is not supported here");
    const int64_t kp = static_cast<int64_t>(x.size());
    if (kp % 32 != 0) throw py::value_error("quantize_row_q8: len(x) must be a multiple of 32");
    std::string rec(static_cast<size_t>(kt::formats::q8_record_bytes(kp)), '\0');
    kt::kernels::quantize_row_q8(isa)(x.data(), kp, reinterpret_cast<uint8_t*>(rec.data()));
    return py::bytes(rec);
  });
  // c = a @ b^T (+ c when accumulate) from tier `isa`'s fp32 NT tiles (kernels/gemm_nt.h),
  // on the rows [i0, i0 + rows) of a and c only (the caller's split of m); a [m, k], b [n, k],
  // c [m, n]: contiguous fp32 tensors. ValueError where the tier has none.
  t.def(
      "gemm_nt_f32",
      [](const at::Tensor& a, const at::Tensor& b, at::Tensor& c, bool accumulate,
         const std::string& isa_name, int64_t i0, int64_t rows) {
        const Isa isa = kt::kernels::parse_isa(isa_name);
        const std::vector<Isa> ok = kt::kernels::supported_isas();
        const kt::kernels::GemmNtF32 nt = std::find(ok.begin(), ok.end(), isa) == ok.end()
                                              ? nullptr
                                              : kt::kernels::gemm_nt_f32(isa);
        if (nt == nullptr)
          throw py::value_error("gemm_nt_f32: ISA '" + isa_name + "' has no such kernel here");
        for (const at::Tensor* x : {&a, &b, static_cast<const at::Tensor*>(&c)})
          if (x->dim() != 2 || x->scalar_type() != at::kFloat || !x->is_contiguous())
            throw py::value_error("gemm_nt_f32: a, b and c must be contiguous 2-D fp32 tensors");
        const int64_t m = a.size(0), k = a.size(1), n = b.size(0);
        if (b.size(1) != k || c.size(0) != m || c.size(1) != n || i0 < 0 || rows < 0 ||
            i0 + rows > m)
          throw py::value_error("gemm_nt_f32: shapes or row range do not match");
        nt(rows, n, k, a.data_ptr<float>() + i0 * k, k, b.data_ptr<float>(), k,
           c.data_ptr<float>() + i0 * n, n, accumulate, kt::kernels::PrefetchChunks{});
      },
      py::arg("a"), py::arg("b"), py::arg("c"), py::arg("accumulate"), py::arg("isa"),
      py::arg("i0"), py::arg("rows"));
  // The LoRA products (moe/lora_products.h) on the active ISA path's kernels (AVX2's,
  // AVX-512's, or at::mm on ref): y = x a^T (x fp32 or bf16 [m, k], a fp32 [r, k]);
  // out (+)= s sum_q t_q w_q (out [m, n] in place; t_q [m, r_q], w_q [r_q, n]); g = s d^T x
  // (d [m, r], x fp32 or bf16 [m, k]). Contiguous 2-D CPU tensors, else ValueError.
  auto check_2d = [](const at::Tensor& t, const char* name, bool bf16_ok) {
    const bool dtype_ok =
        t.scalar_type() == at::kFloat || (bf16_ok && t.scalar_type() == at::kBFloat16);
    if (t.dim() != 2 || !dtype_ok || !t.is_contiguous() || !t.device().is_cpu())
      throw py::value_error(std::string("lora products: ") + name + " must be a contiguous 2-D " +
                            (bf16_ok ? "fp32 or bf16" : "fp32") + " CPU tensor");
  };
  t.def(
      "lora_xat",
      [check_2d](const at::Tensor& x, const at::Tensor& a) {
        check_2d(x, "x", true);
        check_2d(a, "a", false);
        const int64_t m = x.size(0), k = x.size(1), r = a.size(0);
        if (a.size(1) != k) throw py::value_error("lora_xat: a must be [r, k] for x [m, k]");
        at::Tensor y = at::zeros({m, r}, at::kFloat);
        if (x.scalar_type() == at::kBFloat16) {
          std::vector<const uint16_t*> rows(static_cast<size_t>(m));
          const auto* p = static_cast<const uint16_t*>(x.data_ptr());
          for (int64_t i = 0; i < m; ++i) rows[i] = p + i * k;
          kt::moe::lora_products::xat_rows_bf16(rows.data(), m, k, a.data_ptr<float>(), k, r,
                                                y.data_ptr<float>());
        } else {
          kt::moe::lora_products::xat(x.data_ptr<float>(), k, m, k, a.data_ptr<float>(), k, r,
                                      y.data_ptr<float>());
        }
        return y;
      },
      py::arg("x"), py::arg("a"));
  t.def(
      "lora_tw",
      [check_2d](const std::vector<std::pair<at::Tensor, at::Tensor>>& terms, double s,
                 bool accumulate, at::Tensor& out) {
        check_2d(out, "out", false);
        const int64_t m = out.size(0), n = out.size(1);
        if (terms.empty() || terms.size() > 4)
          throw py::value_error("lora_tw: 1 to 4 (t, w) terms");
        std::vector<kt::moe::lora_products::TwTerm> q;
        for (const auto& [tq, wq] : terms) {
          check_2d(tq, "t", false);
          check_2d(wq, "w", false);
          if (tq.size(0) != m || wq.size(0) != tq.size(1) || wq.size(1) != n)
            throw py::value_error("lora_tw: t must be [m, r] and w [r, n] for out [m, n]");
          q.push_back({tq.data_ptr<float>(), tq.size(1), wq.data_ptr<float>(), n});
        }
        std::vector<float*> rows(static_cast<size_t>(m));
        for (int64_t i = 0; i < m; ++i) rows[i] = out.data_ptr<float>() + i * n;
        kt::moe::lora_products::tw_terms(q.data(), static_cast<int>(q.size()), m, n,
                                         static_cast<float>(s), accumulate, rows.data());
      },
      py::arg("terms"), py::arg("s"), py::arg("accumulate"), py::arg("out"));
  t.def(
      "lora_dtx",
      [check_2d](const at::Tensor& d, const at::Tensor& x, double s) {
        check_2d(d, "d", false);
        check_2d(x, "x", true);
        const int64_t m = d.size(0), r = d.size(1), k = x.size(1);
        if (x.size(0) != m) throw py::value_error("lora_dtx: x must be [m, k] for d [m, r]");
        at::Tensor g = at::zeros({r, k}, at::kFloat);
        if (x.scalar_type() == at::kBFloat16) {
          kt::moe::lora_products::dtx_bf16(d.data_ptr<float>(), r, m, r,
                                           static_cast<const uint16_t*>(x.data_ptr()), k, k,
                                           static_cast<float>(s), g.data_ptr<float>(), k);
        } else {
          kt::moe::lora_products::dtx(d.data_ptr<float>(), r, m, r, x.data_ptr<float>(), k, k,
                                      static_cast<float>(s), g.data_ptr<float>(), k);
        }
        return g;
      },
      py::arg("d"), py::arg("x"), py::arg("s"));
  // The byte offset within a cache line of a runtime::AlignedVector<float> of each size
  // (the scratch that kernels read as vectors: all 0).
  t.def("aligned_vector_offsets", [](const std::vector<int64_t>& sizes) {
    std::vector<int64_t> offsets;
    for (int64_t n : sizes) {
      if (n < 0) throw py::value_error("aligned_vector_offsets: sizes must be >= 0");
      kt::runtime::AlignedVector<float> v(static_cast<size_t>(n));
      offsets.push_back(static_cast<int64_t>(reinterpret_cast<uintptr_t>(v.data()) %
                                             kt::runtime::kCacheLineBytes));
    }
    return offsets;
  });
  // The vector FMA units' peak, GFLOP/s, on every thread of kt_ops' pool at once: the best
  // of repeated runs of independent 256-bit FMA chains (kernels/avx2/fma_peak_avx2.cpp)
  // over about `seconds`. benchmarks/machine_peaks.py's fp32 ceiling where it beats
  // torch.mm's. ValueError on a CPU or build without the AVX2 tier.
  t.def(
      "fma_peak_gflops",
      [](double seconds) {
        if (kt::kernels::avx2::fma_chains == nullptr || !kt::runtime::cpu_features().avx2)
          throw py::value_error("fma_peak_gflops: needs the AVX2 tier and an AVX2 CPU");
        if (!(seconds > 0 && seconds <= 60))
          throw py::value_error("fma_peak_gflops: seconds must be in (0, 60]");
        py::gil_scoped_release no_gil;
        kt::runtime::ThreadPool& pool = kt::runtime::ThreadPool::global();
        const int n = pool.num_threads();
        constexpr int64_t kIters = int64_t{1} << 18;  // about 0.5 ms a task on one core
        std::vector<float> sink(static_cast<size_t>(n));
        double best = 0;
        const auto start = std::chrono::steady_clock::now();
        do {
          std::vector<double> flops(static_cast<size_t>(n), 0.0);
          const auto t0 = std::chrono::steady_clock::now();
          pool.run(4 * n, [&](int64_t, int thread) {
            flops[thread] += kt::kernels::avx2::fma_chains(kIters, &sink[thread]);
          });
          const double dt =
              std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
          double total = 0;
          for (double f : flops) total += f;
          best = std::max(best, total / dt / 1e9);
        } while (std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() <
                 seconds);
        return best;
      },
      py::arg("seconds") = 0.5);
  // One fp8 block's E4M3 codes [kp][16] (kp a multiple of 32) as the fp8
  // brgemm's bf16 VNNI tile [kp/2][16][2] (kernels/tiers.h), from the
  // AVX512_VBMI decode ("vbmi") or the AVX512_BW one ("bw"); with `exponents`
  // (mxfp8's UE8M0 bytes [kp/32][16]), each row's values times 2^(E-127).
  t.def(
      "fp8_block_to_bf16_vnni",
      [](const py::bytes& codes, const std::string& decode, const py::object& exponents) {
        const std::string c = codes;
        if (decode != "vbmi" && decode != "bw")
          throw py::value_error("fp8_block_to_bf16_vnni: decode must be 'vbmi' or 'bw', got '" +
                                decode + "'");
        const kt::runtime::CpuFeatures& f = kt::runtime::cpu_features();
        if (kt::kernels::avx512::fp8_to_bf16_vnni == nullptr || !f.avx512 ||
            (decode == "vbmi" && !f.avx512_vbmi))
          throw py::value_error("fp8_block_to_bf16_vnni: the '" + decode +
                                "' decode does not run on this build / CPU");
        if (c.size() % (32 * 16) != 0)
          throw py::value_error("fp8_block_to_bf16_vnni: len(codes) must be a multiple of 512");
        const int64_t kp = static_cast<int64_t>(c.size() / 16);
        std::string e;
        if (!exponents.is_none()) {
          e = exponents.cast<py::bytes>();
          if (static_cast<int64_t>(e.size()) != kp / 32 * 16)
            throw py::value_error("fp8_block_to_bf16_vnni: len(exponents) must be len(codes) / 32");
        }
        std::string out(c.size() * 2, '\0');
        kt::kernels::avx512::fp8_to_bf16_vnni(
            reinterpret_cast<const uint8_t*>(c.data()), kp, reinterpret_cast<uint16_t*>(out.data()),
            16, nullptr, decode == "vbmi",
            exponents.is_none() ? nullptr : reinterpret_cast<const uint8_t*>(e.data()));
        return py::bytes(out);
      },
      py::arg("codes"), py::arg("decode"), py::arg("exponents") = py::none());
  // One mxfp4 block's E2M1 codes (the low plane [kp/8][16][4], kp a multiple of 32) and
  // UE8M0 exponents [kp/32][16] as the bf16 VNNI tile [kp/2][ldb][2] of its 16 columns
  // (kernels/tiers.h, mxfp4_to_bf16_vnni; ldb 16 or 32, the other columns zero).
  t.def(
      "mxfp4_block_to_bf16_vnni",
      [](const py::bytes& codes, const py::bytes& exponents, int64_t ldb) {
        const std::string c = codes, e = exponents;
        if (kt::kernels::avx512::mxfp4_to_bf16_vnni == nullptr ||
            !kt::runtime::cpu_features().avx512)
          throw py::value_error("mxfp4_block_to_bf16_vnni: needs the avx512 tier");
        if (c.empty() || c.size() % 256 != 0)
          throw py::value_error("mxfp4_block_to_bf16_vnni: len(codes) must be a multiple of 256");
        const int64_t kp = static_cast<int64_t>(c.size() / 8);
        if (static_cast<int64_t>(e.size()) != kp / 32 * 16)
          throw py::value_error("mxfp4_block_to_bf16_vnni: len(exponents) must be len(codes) / 16");
        if (ldb != 16 && ldb != 32)
          throw py::value_error("mxfp4_block_to_bf16_vnni: ldb must be 16 or 32");
        std::string out(static_cast<size_t>(kp * ldb * 2), '\0');
        kt::kernels::avx512::mxfp4_to_bf16_vnni(
            reinterpret_cast<const uint8_t*>(c.data()), reinterpret_cast<const uint8_t*>(e.data()),
            kp, reinterpret_cast<uint16_t*>(out.data()), ldb, nullptr);
        return py::bytes(out);
      },
      py::arg("codes"), py::arg("exponents"), py::arg("ldb") = 16);
}

}  // namespace kt::ops
