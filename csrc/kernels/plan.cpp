#include "kernels/plan.h"

#include <atomic>
#include <cstring>

#include "formats/grid.h"
#include "kernels/dispatch.h"
#include "runtime/cpu_features.h"

namespace kt::kernels {

namespace {

constexpr int kRows = formats::kQintBlockRows;  // output rows per block, every layout

std::atomic<QuantActivations> g_quant_activations{QuantActivations::kAuto};
std::atomic<ComputePath> g_compute_path{ComputePath::kAuto};

template <class T, class A>
void grow(std::vector<T, A>& v, size_t n) {
  if (v.size() < n) v.resize(n);
}

// The operand of rows.(source, expert) in form `form` from cache c; on a
// miss, n bytes made by fill(dst).
template <class Fill>
const uint8_t* cached(OperandCache& c, const ExpertRows& rows, const void* form, size_t n,
                      const Fill& fill) {
  if (c.source != rows.source || c.expert != rows.expert || c.form != form) {
    grow(c.bytes, n);
    fill(c.bytes.data());
    c.source = rows.source;
    c.expert = rows.expert;
    c.form = form;
  }
  return c.bytes.data();
}

// TileInput::kBf16Rows: the rows in place where they are one run per expert
// (the driver's bf16 GLU outputs), else gathered by token at
// tile_rows_ld(kp) (64 rows of H = 2048 are 256 KiB: they stay in L2 while
// the thread computes the expert's blocks).
const uint16_t* bf16_rows(const ExpertRows& rows, int64_t kp, ThreadScratch& ts, int64_t* ld) {
  if (rows.bf16_index == nullptr) {
    *ld = rows.bf16_ld;
    return rows.bf16;
  }
  const int64_t l = tile_rows_ld(kp);
  *ld = l;
  const size_t n = static_cast<size_t>(rows.m) * l * sizeof(uint16_t);
  return reinterpret_cast<const uint16_t*>(
      cached(ts.bf16_rows, rows, nullptr, n, [&](uint8_t* dst) {
        auto* d = reinterpret_cast<uint16_t*>(dst);
        for (int i = 0; i < rows.m; ++i)
          std::memcpy(d + i * l, rows.bf16 + rows.bf16_index[i] * rows.bf16_ld,
                      kp * sizeof(uint16_t));
      }));
}

}  // namespace

void set_quant_activations(QuantActivations mode) { g_quant_activations.store(mode); }
QuantActivations quant_activations() { return g_quant_activations.load(); }
void set_compute_path(ComputePath path) { g_compute_path.store(path); }
ComputePath compute_path() { return g_compute_path.load(); }

formats::BrgemmIsa brgemm_class() {
  const runtime::CpuFeatures& f = runtime::cpu_features();
  if (f.amx) return formats::BrgemmIsa::kAmx;
  return f.intel ? formats::BrgemmIsa::kAvx512Intel : formats::BrgemmIsa::kAvx512;
}

int fp32_min_tokens(const formats::FormatRow& format, Isa isa) {
  const ProjectionKernels& k = projection_kernels(format.layout, isa);
  if (k.dot_fp32 == nullptr) return formats::kNoFp32Path;
  return format.fp32_min_tokens.min(k.fp32_class);
}

TilePath tile_path(const formats::FormatRow& format, Isa isa, const Modes& modes) {
  constexpr TilePath kNone{nullptr, formats::kNoBrgemm};
  if (modes.path == ComputePath::kStreaming) return kNone;
  // Each tile kernel says under which quant modes it runs (TileKernel::quant_modes):
  // per-token int8 activations (w8a8) only under 'auto'; the q8 records' kernel
  // (u8s8) not under 'fp32'; int8 times bf16 activations exactly only under 'fp32'.
  const uint8_t bit = modes.quant == QuantActivations::kAuto ? kQuantAutoBit
                      : modes.quant == QuantActivations::kQ8 ? kQuantQ8Bit
                                                             : kQuantFp32Bit;
  const TileKernel* k = tile_kernel(format, isa, bit);
  if (k == nullptr) return kNone;
  if (modes.path == ComputePath::kBrgemm) return {k, 1};
  if (k->forced_only) return kNone;
  const int min = format.brgemm.min(brgemm_class());
  return min == formats::kNoBrgemm ? kNone : TilePath{k, min};
}

void ThreadScratch::reset() {
  for (OperandCache* c : {&bf16_rows, &u8_tiles, &q8_packed}) {
    c->source = -1;
    c->expert = -1;
    c->form = nullptr;
  }
  tile.reset();
  grid_view = nullptr;
  grid_expert = grid_block = -1;
}

size_t ThreadScratch::bytes() const {
  return bf16_rows.bytes.capacity() + u8_tiles.bytes.capacity() + q8_packed.bytes.capacity() +
         block.capacity() * sizeof(float) + grid_panel.capacity() + tile.bytes();
}

void CallScratch::begin(int threads) {
  if (threads_.size() < static_cast<size_t>(threads)) threads_.resize(threads);
  for (ThreadScratch& t : threads_) t.reset();
}

size_t CallScratch::bytes() const {
  size_t n = threads_.capacity() * sizeof(ThreadScratch);
  for (const ThreadScratch& t : threads_) n += t.bytes();
  return n;
}

ProjectionPlan::ProjectionPlan(const formats::FormatRow& format, const ProjectionView& view,
                               Isa isa, const Modes& modes, bool bf16_activations)
    : view_(&view), streaming_(&projection_kernels(format.layout, isa)) {
  fp32_min_ = formats::kNoFp32Path;
  if (modes.quant == QuantActivations::kFp32 && streaming_->dot_fp32 != nullptr) fp32_min_ = 1;
  if (modes.quant == QuantActivations::kAuto) fp32_min_ = fp32_min_tokens(format, isa);
  q8_ = format.activation == formats::ActType::kQ8 && fp32_min_ > 1;
  // 'auto' takes a tile kernel that rounds the activations to bf16 only for
  // bf16 activations: bf16 multiplies them exactly (the GLU outputs are
  // rounded to bf16, as in torch's bf16 expert MLP), fp8 rounds them once
  // with its scales; fp32 and fp16 activations keep their precision on the
  // streaming kernels unless 'brgemm' is forced.
  const TilePath tile = tile_path(format, isa, modes);
  const bool allowed = tile.kernel != nullptr &&
                       (tile.kernel->applies_to == nullptr || tile.kernel->applies_to(view)) &&
                       (modes.path == ComputePath::kBrgemm || bf16_activations ||
                        !tile.kernel->bf16_activations_only);
  tile_ = allowed ? tile.kernel : nullptr;
  tile_min_ = allowed ? tile.min_tokens : formats::kNoBrgemm;
  // 8-bit codes, IQ4_NL's values, the grid formats' int8 panels; folded per 32 (the u8
  // tiles' unit: panels with scales per 16 take the sign-trick kernel).
  u8_codes_ =
      q8_ && streaming_->dot_u8 != nullptr &&
      (format.layout == formats::Layout::kQint || format.layout == formats::Layout::kGrid) &&
      format.qint.is_signed && formats::qint_fold_unit(view.qint.group_size) == 32;
}

const char* ProjectionPlan::kernel_name(int m) const {
  switch (family(m)) {
    case Family::kTile:
      return tile_->name;
    case Family::kWeightOnlyFp32:
      return streaming_->fp32_name;
    case Family::kStreaming:
    case Family::kStreamingU8:
      break;
  }
  return streaming_->name;
}

ProjectionView ProjectionPlan::grid_panel(int64_t expert, int64_t nb, ThreadScratch& ts) const {
  const int64_t kp = view_->kp;
  const size_t bytes = static_cast<size_t>(formats::grid_panel_bytes(view_->grid, kp)) + 64;
  grow(ts.grid_panel, bytes);
  const auto base = reinterpret_cast<uintptr_t>(ts.grid_panel.data());
  auto* panel = reinterpret_cast<uint8_t*>((base + 63) & ~uintptr_t{63});
  if (ts.grid_view != view_ || ts.grid_expert != expert || ts.grid_block != nb) {
    formats::grid_decode_block(view_->grid, view_->block(expert, nb), kp, panel);
    ts.grid_view = view_;
    ts.grid_expert = expert;
    ts.grid_block = nb;
  }
  ProjectionView v = *view_;
  v.layout = formats::Layout::kQint;
  v.grid = formats::GridType::kNone;
  v.weight = panel;
  v.scales = panel + 16 * kp;
  v.zeros = nullptr;
  v.row_blocks = 1;
  v.groups = kp / formats::grid_group_k(view_->grid);
  v.block_bytes = formats::qint_block_bytes(8, kp);
  return v;
}

void ProjectionPlan::dot(const ExpertRows& rows, int64_t nb, float* out, ThreadScratch& ts) const {
  DotArgs a{view_, rows.expert, nb, nb + 1, rows.x, rows.xq, rows.m, out, kRows};
  const int64_t kp = view_->kp;
  ProjectionView panel;
  if (view_->layout == formats::Layout::kGrid) {  // its block as a kQint panel of one block
    panel = grid_panel(rows.expert, nb, ts);
    a = DotArgs{&panel, 0, 0, 1, rows.x, rows.xq, rows.m, out, kRows};
  }
  switch (family(rows.m)) {
    case Family::kTile:
      return dot_tile(a, rows, ts);
    case Family::kWeightOnlyFp32:
      grow(ts.block, static_cast<size_t>(kRows) * kp);
      return streaming_->dot_fp32(a, ts.block.data());
    case Family::kStreamingU8: {
      const size_t n = static_cast<size_t>(rows.m) * kp;
      const uint8_t* tiles = cached(ts.u8_tiles, rows, nullptr, n,
                                    [&](uint8_t* dst) { pack_u8_tiles(rows.xq, rows.m, kp, dst); });
      return streaming_->dot_u8(a, tiles);
    }
    case Family::kStreaming:
      return streaming_->dot(a);
  }
}

TileOperand ProjectionPlan::tile_operand(const ExpertRows& rows, ThreadScratch& ts) const {
  const int64_t kp = view_->kp;
  TileOperand op{nullptr, 0, &ts.tile};
  switch (tile_->input) {
    case TileInput::kBf16Rows:
      op.rows = bf16_rows(rows, kp, ts, &op.ld);
      break;
    case TileInput::kBf16Packed: {
      const size_t n = static_cast<size_t>(tile_->pack_bytes(rows.m, kp));
      op.rows = cached(ts.q8_packed, rows, tile_, n, [&](uint8_t* dst) {
        int64_t ld = 0;
        const uint16_t* r = bf16_rows(rows, kp, ts, &ld);
        tile_->pack_bf16(r, ld, rows.m, kp, dst);
      });
      break;
    }
    case TileInput::kQ8Packed: {
      const size_t n = static_cast<size_t>(tile_->pack_bytes(rows.m, kp));
      op.rows = cached(ts.q8_packed, rows, tile_, n,
                       [&](uint8_t* dst) { tile_->pack(rows.xq, rows.m, kp, dst); });
      break;
    }
    case TileInput::kI8TokenRows: {
      const size_t n = static_cast<size_t>(tile_->pack_bytes(rows.m, kp));
      op.rows = cached(ts.q8_packed, rows, tile_, n,
                       [&](uint8_t* dst) { tile_->pack_rows(rows.x, rows.m, kp, dst); });
      break;
    }
    case TileInput::kFp32Rows:
      break;
  }
  if (tile_->keeps || (tile_->keeps_if != nullptr && tile_->keeps_if()))
    ts.tile.reserve(rows.m, kp);
  if (tile_->release != nullptr) ts.release = tile_->release;
  return op;
}

void ProjectionPlan::dot_tile(const DotArgs& a, const ExpertRows& rows, ThreadScratch& ts) const {
  tile_->dot(a, tile_operand(rows, ts));
}

void ProjectionPlan::dot_pair(const ProjectionPlan& other, const ExpertRows& rows, int64_t nb,
                              float* out, float* other_out, ThreadScratch& ts) const {
  const bool paired = tile_ != nullptr && tile_ == other.tile_ && tile_->dot_pair != nullptr &&
                      family(rows.m) == Family::kTile && other.family(rows.m) == Family::kTile &&
                      view_->layout != formats::Layout::kGrid && view_->k == other.view_->k &&
                      view_->kp == other.view_->kp;
  if (!paired) {
    dot(rows, nb, out, ts);
    other.dot(rows, nb, other_out, ts);
    return;
  }
  const DotArgs a{view_, rows.expert, nb, nb + 1, rows.x, rows.xq, rows.m, out, kRows};
  const DotArgs b{other.view_, rows.expert, nb, nb + 1, rows.x, rows.xq, rows.m, other_out, kRows};
  tile_->dot_pair(a, b, tile_operand(rows, ts));
}

}  // namespace kt::kernels
