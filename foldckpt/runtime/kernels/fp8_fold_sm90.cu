// The fp8 decode fold GEMM on Hopper (sm_90a): y[M, N] = (x[M, K] . W[N, K]^T) * scale[N], W e4m3,
// x and y bf16, fp32 accumulation, for the few tokens of a decode step (M <= 8 * FOLD_NT).
//
// Why this shape (foldckpt/runtime/kernels/cuda_fp8.py has the host side and the dispatch rules):
// at decode the fold GEMM is a stream of W (10.6 MB for Kimi-K3 at TP8) with almost no arithmetic,
// so what sets its time is how many bytes every SM keeps in flight from the first cycle on.
// - Every CTA owns a contiguous slice of whole rows of W (ragged: N / gridDim rows, one more for
//   the first N % gridDim CTAs), so one wave of one CTA per SM covers W with no split-K and no
//   reduction between CTAs. The host launches one CTA per SM.
// - A producer warp issues the whole slice at once as bulk copies (cp.async.bulk, one per row,
//   evict-first in L2) into shared memory, 16 rows a group, each group completing on its own
//   mbarrier; where the slice does not fit, groups take turns in a ring of FOLD slots. The copies
//   go out BEFORE griddepcontrol.wait: W does not depend on the previous kernel, so under
//   programmatic dependent launch its bytes stream while that kernel drains.
// - Eight consumer warps wait for the previous kernel (griddepcontrol.wait), stage x in shared
//   memory as fp16, then each takes one eighth of K for every group as it lands: e4m3 -> fp16 in
//   registers (exact), mma.sync m16n8k16 with W's rows on the MMA's M side and the tokens on its
//   N side (swap-AB: W is never padded, only x), fp32 accumulators.
// - A thread's 16 bytes of a row feed four MMAs: the MMA's k order inside a 64-wide step is a
//   permutation of the true one, the same for W and x, so every operand is one 16-byte shared
//   load and the dot products are unchanged. Rows are padded in shared memory so that these
//   loads hit distinct banks.
// - The eight partial sums meet in shared memory (in warp order: the result does not depend on
//   timing), are scaled per row and stored once.
// The kernel never triggers its dependents early: a kernel after it waits for it as usual.
//
// No headers: NVRTC compiles this file as it is (foldckpt/runtime/kernels/cuda_fp8.py), and so
// does nvcc (scripts/build_fp8_fold_cubin.sh, for ptxas's report and the SASS).

#ifndef FOLD_NT
#define FOLD_NT 2  // token tiles of 8: M <= 8 * FOLD_NT
#endif
#ifndef FOLD_GROUPS
#define FOLD_GROUPS 4  // 16-row groups a CTA owns at most: rows per CTA <= 16 * FOLD_GROUPS
#endif
#ifndef FOLD_K
#define FOLD_K 1536  // the reduction length (q_lora_rank of every model of the family)
#endif
#ifndef FOLD_CVT
#define FOLD_CVT 0  // e4m3 -> fp16: 0 cvt.rn.f16x2.e4m3x2; 1 integer bit moves; 2 cvt for rows r, bits for r + 8
#endif

#define FOLD_CONSUMER_WARPS 8
#define FOLD_THREADS ((FOLD_CONSUMER_WARPS + 1) * 32)
#define FOLD_MAX_SLOTS 16

typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned long long u64;

struct FoldArgs {
  const unsigned char* w;  // [N, K] e4m3, contiguous
  const float* scale;      // [N]
  const u16* x;            // [M, ldx] bf16
  u16* y;                  // [M, ldy] bf16
  int m, n, ldx, ldy;
  int row_stride;  // bytes per W row in shared memory: k rounded up to 64 mod 128
  int x_stride;    // bytes per token of x in shared memory: 2 k rounded up to 16 mod 128
  int slots;       // 16-row groups resident at once (<= FOLD_MAX_SLOTS)
  int x_offset;    // bytes before x in shared memory: the W slots, or the partial sums if larger
};

__device__ __forceinline__ u32 smem_addr(const void* p) {
  return static_cast<u32>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void mbar_init(u64* bar, u32 count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count));
}

__device__ __forceinline__ void mbar_expect_tx(u64* bar, u32 bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes)
               : "memory");
}

__device__ __forceinline__ void mbar_arrive(u64* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_addr(bar)) : "memory");
}

__device__ __forceinline__ void mbar_wait(u64* bar, u32 parity) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "WAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT_%=;\n"
      "}\n" ::"r"(smem_addr(bar)),
      "r"(parity)
      : "memory");
}

__device__ __forceinline__ void bulk_copy_row(void* dst, const void* src, u32 bytes, u64* bar, u64 policy) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], %4;" ::
          "r"(smem_addr(dst)),
      "l"(src), "r"(bytes), "r"(smem_addr(bar)), "l"(policy)
      : "memory");
}

__device__ __forceinline__ u32 bf16x2_to_f16x2(u32 v) {
  // bf16 -> fp32 is a shift; fp32 -> fp16 rounds to nearest (exact where x lies: see cuda_fp8.py).
  float lo = __uint_as_float(v << 16), hi = __uint_as_float(v & 0xffff0000u);
  u32 r;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}

// Four e4m3 bytes (k, k+1, k+2, k+3) -> two fp16x2 words (k, k+1) and (k+2, k+3).
__device__ __forceinline__ void e4m3x4_cvt(u32 v, u32& lo, u32& hi) {
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(lo) : "h"(static_cast<u16>(v & 0xffffu)));
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(hi) : "h"(static_cast<u16>(v >> 16)));
}

// The same by moving bits: a byte s.eeee.mmm placed as fp16 s.0eeee.mmm0000000 is the e4m3 value
// times 2^-8 (normal and subnormal alike: the two biases differ by 8), undone in the epilogue.
__device__ __forceinline__ void e4m3x4_bits(u32 v, u32& lo, u32& hi) {
  u32 p = __byte_perm(v, 0u, 0x1404u), q = __byte_perm(v, 0u, 0x3424u);
  lo = (p & 0x80008000u) | ((p & 0x7f007f00u) >> 1);
  hi = (q & 0x80008000u) | ((q & 0x7f007f00u) >> 1);
}

__device__ __forceinline__ void mma_16816(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// The fp32 factor that undoes the bit conversion's 2^-8 for a row held at position r16 of its group.
__device__ __forceinline__ float cvt_factor(int r16) {
#if FOLD_CVT == 1
  return 256.0f;
#elif FOLD_CVT == 2
  return r16 >= 8 ? 256.0f : 1.0f;
#else
  return 1.0f;
#endif
}

extern "C" __global__ void __launch_bounds__(FOLD_THREADS, 1) foldckpt_fp8_fold(const FoldArgs a) {
  extern __shared__ __align__(128) unsigned char smem[];
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int base_rows = a.n / gridDim.x, extra = a.n % gridDim.x;
  const int rows = base_rows + (blockIdx.x < extra ? 1 : 0);
  const int row0 = blockIdx.x * base_rows + min(static_cast<int>(blockIdx.x), extra);
  const int groups = (rows + 15) >> 4;
  const int group_bytes = 16 * a.row_stride;

  unsigned char* w_smem = smem;
  unsigned char* x_smem = smem + a.x_offset;
  u64* full = reinterpret_cast<u64*>(x_smem + 8 * FOLD_NT * a.x_stride);
  u64* empty = full + FOLD_MAX_SLOTS;

  if (tid == 0) {
    for (int s = 0; s < a.slots; ++s) {
      mbar_init(&full[s], 1);
      mbar_init(&empty[s], FOLD_CONSUMER_WARPS);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();

  if (warp == FOLD_CONSUMER_WARPS) {
    // The producer: every row of the slice, in group order, as soon as its slot is free.
    u64 policy;
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
    for (int g = 0; g < groups; ++g) {
      const int slot = g % a.slots;
      if (g >= a.slots) mbar_wait(&empty[slot], ((g / a.slots) - 1) & 1);
      const int n_rows = min(16, rows - 16 * g);
      if (lane == 0) mbar_expect_tx(&full[slot], static_cast<u32>(n_rows * FOLD_K));
      __syncwarp();
      if (lane < n_rows) {
        const unsigned char* src = a.w + static_cast<size_t>(row0 + 16 * g + lane) * FOLD_K;
        bulk_copy_row(w_smem + slot * group_bytes + lane * a.row_stride, src, FOLD_K, &full[slot], policy);
      }
    }
    return;
  }

  // Consumers: x is the previous kernel's output, so wait for it (a no-op without PDL).
  asm volatile("griddepcontrol.wait;" ::: "memory");
  constexpr int k_chunks = FOLD_K / 8;  // 8 bf16 = 16 bytes
  for (int c = tid; c < a.m * k_chunks; c += 32 * FOLD_CONSUMER_WARPS) {
    const int t = c / k_chunks, kc = c - t * k_chunks;
    const uint4 v = *reinterpret_cast<const uint4*>(a.x + static_cast<size_t>(t) * a.ldx + kc * 8);
    uint4 h;
    h.x = bf16x2_to_f16x2(v.x);
    h.y = bf16x2_to_f16x2(v.y);
    h.z = bf16x2_to_f16x2(v.z);
    h.w = bf16x2_to_f16x2(v.w);
    *reinterpret_cast<uint4*>(x_smem + t * a.x_stride + kc * 16) = h;
  }
  asm volatile("bar.sync 1, %0;" ::"n"(32 * FOLD_CONSUMER_WARPS) : "memory");

  // This warp's share of K: STEPS steps of 64, each lane 16 bytes of a row (4 MMAs' worth of k).
  const int q = lane & 3, r = lane >> 2;
  const int k_warp = warp * (FOLD_K / FOLD_CONSUMER_WARPS);
  constexpr int STEPS = FOLD_K / FOLD_CONSUMER_WARPS / 64;

  // x for a step: token r of each 8-token tile, k = kb .. kb + 15 (32 bytes). Up to 2 tiles it is
  // loaded once and held for all groups; with 4 the registers go to the accumulators instead, and
  // each group reloads it (from shared memory, a tenth of the W bytes it converts).
  constexpr bool HOLD_X = FOLD_NT <= 2;
  u32 xw[HOLD_X ? STEPS : 1][FOLD_NT][8];
  auto load_x = [&](int s, u32 (&dst)[FOLD_NT][8]) {
#pragma unroll
    for (int t = 0; t < FOLD_NT; ++t) {
      const unsigned char* xp = x_smem + (8 * t + r) * a.x_stride + 2 * (k_warp + 64 * s + 16 * q);
      const uint4 v0 = *reinterpret_cast<const uint4*>(xp), v1 = *reinterpret_cast<const uint4*>(xp + 16);
      dst[t][0] = v0.x, dst[t][1] = v0.y, dst[t][2] = v0.z, dst[t][3] = v0.w;
      dst[t][4] = v1.x, dst[t][5] = v1.y, dst[t][6] = v1.z, dst[t][7] = v1.w;
    }
  };
  if constexpr (HOLD_X) {
#pragma unroll
    for (int s = 0; s < STEPS; ++s) load_x(s, xw[s]);
  }

  float acc[FOLD_GROUPS][FOLD_NT][4];
#pragma unroll
  for (int g = 0; g < FOLD_GROUPS; ++g)
#pragma unroll
    for (int t = 0; t < FOLD_NT; ++t)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[g][t][i] = 0.0f;

#pragma unroll
  for (int g = 0; g < FOLD_GROUPS; ++g) {
    if (g < groups) {
      const int slot = g % a.slots;
      mbar_wait(&full[slot], (g / a.slots) & 1);
      const unsigned char* wp = w_smem + slot * group_bytes + r * a.row_stride + k_warp + 16 * q;
#pragma unroll
      for (int s = 0; s < STEPS; ++s) {
        if constexpr (!HOLD_X) load_x(s, xw[0]);
        u32(&x_step)[FOLD_NT][8] = xw[HOLD_X ? s : 0];
        const uint4 w_lo = *reinterpret_cast<const uint4*>(wp + 64 * s);                     // row r
        const uint4 w_hi = *reinterpret_cast<const uint4*>(wp + 64 * s + 8 * a.row_stride);  // row r + 8
        const u32 lo_words[4] = {w_lo.x, w_lo.y, w_lo.z, w_lo.w};
        const u32 hi_words[4] = {w_hi.x, w_hi.y, w_hi.z, w_hi.w};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          u32 frag[4];
#if FOLD_CVT == 1
          e4m3x4_bits(lo_words[j], frag[0], frag[2]);
          e4m3x4_bits(hi_words[j], frag[1], frag[3]);
#elif FOLD_CVT == 2
          e4m3x4_cvt(lo_words[j], frag[0], frag[2]);
          e4m3x4_bits(hi_words[j], frag[1], frag[3]);
#else
          e4m3x4_cvt(lo_words[j], frag[0], frag[2]);
          e4m3x4_cvt(hi_words[j], frag[1], frag[3]);
#endif
#pragma unroll
          for (int t = 0; t < FOLD_NT; ++t) mma_16816(acc[g][t], frag, x_step[t][2 * j], x_step[t][2 * j + 1]);
        }
      }
      // In a ring, the slot is free once every warp has read the group.
      if (a.slots < groups) {
        __syncwarp();
        if (lane == 0) mbar_arrive(&empty[slot]);
      }
    }
  }

  // The eight partial sums meet in shared memory, reusing W's slots: red[warp][token][row].
  asm volatile("bar.sync 1, %0;" ::"n"(32 * FOLD_CONSUMER_WARPS) : "memory");
  const int rows_pad = 16 * FOLD_GROUPS + 4;  // + 4: a warp's stores of one row set hit distinct banks
  float* red = reinterpret_cast<float*>(w_smem);
#pragma unroll
  for (int g = 0; g < FOLD_GROUPS; ++g) {
    if (g < groups) {
#pragma unroll
      for (int t = 0; t < FOLD_NT; ++t) {
        float* base = red + (warp * 8 * FOLD_NT + 8 * t + 2 * q) * rows_pad + 16 * g + r;
        base[0] = acc[g][t][0];
        base[rows_pad] = acc[g][t][1];
        base[8] = acc[g][t][2];
        base[rows_pad + 8] = acc[g][t][3];
      }
    }
  }
  asm volatile("bar.sync 1, %0;" ::"n"(32 * FOLD_CONSUMER_WARPS) : "memory");
  for (int i = tid; i < a.m * rows; i += 32 * FOLD_CONSUMER_WARPS) {
    const int t = i / rows, row = i - t * rows;
    float sum = 0.0f;
#pragma unroll
    for (int w = 0; w < FOLD_CONSUMER_WARPS; ++w) sum += red[(w * 8 * FOLD_NT + t) * rows_pad + row];
    const float v = sum * (cvt_factor(row & 15) * a.scale[row0 + row]);
    u16 out;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(out) : "f"(v));
    a.y[static_cast<size_t>(t) * a.ldy + row0 + row] = out;
  }
}
