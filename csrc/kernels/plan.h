// The compute plan: a plan object decides, kernels compute (as oneDNN's
// primitive descriptors and ruy's TrMulParams).
// For one projection of one op call, from the projection's format row and
// view, the active ISA tier, the process-wide modes and whether the hidden
// states are bf16, the plan says which kernel family computes an expert of m
// tokens:
//
//   Family::kStreaming        ProjectionKernels::dot, the format's own streaming
//                             kernel (q8 integer dots for the qint formats, E4M3
//                             decoded in registers for fp8, bf16 widened for bf16)
//   Family::kStreamingU8      ProjectionKernels::dot_u8: the same on u8 codes
//                             (8-bit signed formats, AVX512_VNNI)
//   Family::kWeightOnlyFp32   ProjectionKernels::dot_fp32: blocks decoded to fp32
//   Family::kTile             a TileKernel: brgemm bf16 / fp8 / u8s8, or kt_ops'
//                             own bf16 / fp8 tiles (tile_kernel() names which)
//
// from the tier table (kernels/dispatch.cpp: every family, with its
// fallbacks) and the format table's measured break-evens
// (formats/format_table.h: fp32_min_tokens, brgemm). For an expert it then
// makes the operand its family reads (gathered bf16 rows, u8 tiles, a tile
// kernel's packed q8 rows) in the calling pool thread's scratch and runs the
// kernel.
// The driver (csrc/moe) asks the plan and never names a family's operands;
// kt_ops.compute_paths() and kt_ops.info() report from the same functions
// (tile_path, fp32_min_tokens).
//
// Scratch: every buffer of the kernel families lives in one CallScratch per
// op call (one ThreadScratch per pool thread, owned by the calling thread's
// driver state and reused across its calls), emptied when a call starts: the
// caches in it are keyed by (rows, expert) within that call, never across
// calls.
#pragma once

#include <cstdint>
#include <vector>

#include "formats/format_table.h"
#include "kernels/isa.h"
#include "kernels/kernel_api.h"
#include "runtime/aligned_vector.h"

namespace kt::kernels {

// What the quantized formats multiply the activations with, per (expert,
// projection) (docs/formats.md, "Compute paths"):
//   kQ8:   each format's own kernel: q8 integer dot products for the qint
//          formats (w8a8 / w4a8), codes decoded in registers for fp8;
//   kFp32: every format decodes each block once to fp32 W (scale * q - zero)
//          and multiplies fp32 activations (weight-only, the w4a16 path);
//   kAuto: kFp32 when the expert has at least fp32_min_tokens(format, isa)
//          tokens (the format row's threshold for the tier's kernel class),
//          else kQ8.
// bf16 has one path (fp32 activations). Process-wide; kAuto by default.
enum class QuantActivations { kAuto, kQ8, kFp32 };
void set_quant_activations(QuantActivations mode);
QuantActivations quant_activations();

// Which kernels compute an expert's products (docs/formats.md, "Compute paths"):
//   kStreaming: the streaming families (decode kernels that stream each 16-row
//               block once, register-tiled over tokens);
//   kBrgemm:    the tile family of the tier table (tile_kernel) at any token
//               count, for the formats and CPUs on which one runs; the others
//               stream;
//   kAuto:      the tile family for experts with at least the format row's
//               brgemm.min_tokens for this CPU class, else streaming; a tile
//               kernel that rounds activations to bf16 (bf16, fp8) only for
//               bf16 activations (fp32 / fp16 activations stream); the u8s8
//               kernel (int8, q8_0) for any activations (it reproduces the q8
//               kernels' bits).
// A tile kernel on q8 records (u8s8) never runs under QuantActivations::kFp32.
// Process-wide; kAuto by default.
enum class ComputePath { kAuto, kStreaming, kBrgemm };
void set_compute_path(ComputePath path);
ComputePath compute_path();

// The two modes, read once per op call.
struct Modes {
  ComputePath path;
  QuantActivations quant;
  static Modes current() { return {compute_path(), quant_activations()}; }
};

enum class Family : uint8_t { kStreaming, kStreamingU8, kWeightOnlyFp32, kTile };

// Tokens per expert from which 'auto' sends projections of `format` to the
// weight-only fp32 path on tier `isa` (the row's Fp32Policy for the class of
// the tier's kernels); formats::kNoFp32Path: never.
int fp32_min_tokens(const formats::FormatRow& format, Isa isa);

// The CPU class whose brgemm thresholds 'auto' follows (formats::BrgemmPolicy): AMX,
// an Intel CPU without it, or another AVX-512 CPU.
formats::BrgemmIsa brgemm_class();

// The tile family of `format` on tier `isa` under `modes`: the kernel, and
// the tokens per expert from which it computes (1 under kBrgemm; the format
// row's BrgemmPolicy for this CPU class under kAuto, before the bf16
// activations rule). {nullptr, formats::kNoBrgemm} where none runs.
struct TilePath {
  const TileKernel* kernel;
  int min_tokens;
};
TilePath tile_path(const formats::FormatRow& format, Isa isa, const Modes& modes);
// Under the current modes: what kt_ops.compute_paths() reports.
inline TilePath tile_path(const formats::FormatRow& format, Isa isa) {
  return tile_path(format, isa, Modes::current());
}

// One expert's activation rows, in the forms the driver made for this call
// (ProjectionPlan::reads_q8 / reads_bf16 say which a plan needs).
struct ExpertRows {
  // Which rows: 0 the layer's input x (gate, up), 1 the GLU outputs h (down).
  // With `expert` it keys the operands made from these rows within a call.
  int source;
  int64_t expert;
  int m;
  const float* const* x;     // m fp32 rows, kp long
  const uint8_t* const* xq;  // their q8 records, or nullptr
  // Their bf16 rows, or nullptr: row i at bf16 + index[i] * bf16_ld, or at
  // bf16 + i * bf16_ld where index is nullptr (then used in place).
  const uint16_t* bf16;
  int64_t bf16_ld;
  const int64_t* bf16_index;
};

// One operand made from an expert's rows, kept while the thread stays on them;
// keyed by (source, expert) and the form it was made in (the TileKernel whose
// pack made it; nullptr for the forms the plan makes itself).
struct OperandCache {
  std::vector<uint8_t> bytes;
  int source = -1;
  int64_t expert = -1;
  const void* form = nullptr;
};

// The scratch of the kernel families on one pool thread within one op call.
// Its own cache lines: the pool threads' slots sit side by side in one array,
// and a tile kernel updates its slot's keys at every block.
struct alignas(64) ThreadScratch {
  OperandCache bf16_rows;  // TileInput::kBf16Rows gathered at tile_rows_ld(kp)
  OperandCache u8_tiles;   // Family::kStreamingU8's tiles (pack_u8_tiles)
  OperandCache q8_packed;  // TileInput::kQ8Packed / kI8TokenRows / kBf16Packed (the packs)
  runtime::AlignedVector<float> block;  // Family::kWeightOnlyFp32: one block decoded, [kp][16]
  // The grid formats: one block decoded to its int8 panel (formats/grid.h), 64-byte
  // aligned inside, and which block it holds (view, expert, block; view nullptr: none).
  std::vector<uint8_t> grid_panel;
  const ProjectionView* grid_view = nullptr;
  int64_t grid_expert = -1, grid_block = -1;
  TileScratch tile;  // TileKernel::keeps
  // The TileKernel::release owed after this thread's run of calls, or nullptr.
  void (*release)() = nullptr;

  void reset();
  size_t bytes() const;
};

// The kernel families' scratch of one op call: a ThreadScratch per pool
// thread index. begin() empties every cache (keeping the memory) when a call
// starts; only thread i touches at(i) during the call's pool jobs.
class CallScratch {
 public:
  // Starts a call whose pool jobs have thread indices below `threads`.
  void begin(int threads);
  ThreadScratch& at(int thread) { return threads_[static_cast<size_t>(thread)]; }
  size_t bytes() const;

 private:
  std::vector<ThreadScratch> threads_;
};

// After a pool thread's run of calls (ThreadPool::parallel_for's run): the
// release its tile kernel owes (the AMX tile configuration), if any.
inline void end_run(ThreadScratch& ts) {
  if (ts.release == nullptr) return;
  ts.release();
  ts.release = nullptr;
}

// The plan of one projection for one op call.
class ProjectionPlan {
 public:
  ProjectionPlan(const formats::FormatRow& format, const ProjectionView& view, Isa isa,
                 const Modes& modes, bool bf16_activations);

  // The family that computes an expert of m tokens.
  Family family(int m) const {
    if (m >= tile_min_) return Family::kTile;
    if (m >= fp32_min_) return Family::kWeightOnlyFp32;
    return u8_codes_ ? Family::kStreamingU8 : Family::kStreaming;
  }
  // The tile kernel of Family::kTile, or nullptr.
  const TileKernel* tile_kernel() const { return tile_; }
  // The name of the kernel that computes an expert of m tokens.
  const char* kernel_name(int m) const;

  // Whether some expert may read q8 records (the driver makes them per call).
  bool reads_q8() const { return q8_; }
  // Whether an expert of m tokens reads bf16 rows (ExpertRows::bf16).
  bool reads_bf16(int m) const {
    return tile_ != nullptr &&
           (tile_->input == TileInput::kBf16Rows || tile_->input == TileInput::kBf16Packed) &&
           m >= tile_min_;
  }

  // out[i * 16 + r] (i < rows.m, r < 16) = the dot products of block nb of
  // rows.expert with the rows, by family(rows.m); operands and scratch in ts.
  void dot(const ExpertRows& rows, int64_t nb, float* out, ThreadScratch& ts) const;
  // dot of this plan into out and of `other` (the up projection beside this gate, the same
  // rows and k) into other_out: one TileKernel::dot_pair pass where both run the same tile
  // kernel that has one, else the two dots. The same results either way.
  void dot_pair(const ProjectionPlan& other, const ExpertRows& rows, int64_t nb, float* out,
                float* other_out, ThreadScratch& ts) const;

 private:
  void dot_tile(const DotArgs& a, const ExpertRows& rows, ThreadScratch& ts) const;
  TileOperand tile_operand(const ExpertRows& rows, ThreadScratch& ts) const;
  // The grid formats: block nb of `expert` decoded into ts's panel (kept while the
  // thread stays on it), as a one-block kQint view of that panel.
  ProjectionView grid_panel(int64_t expert, int64_t nb, ThreadScratch& ts) const;

  const ProjectionView* view_;
  const ProjectionKernels* streaming_;
  const TileKernel* tile_;  // nullptr: no tile family in this call
  int tile_min_;            // experts with at least this many rows take tile_
  int fp32_min_;            // ... else, with at least this many, dot_fp32
  bool q8_;                 // some expert may read q8 records
  bool u8_codes_;           // the streaming q8 kernel takes u8 tiles (dot_u8)
};

}  // namespace kt::kernels
