/* PagedAttention as one onnxruntime CPU custom op (domain "pagedkit.cpu"): the prologue (packed QKV split,
 * QK-norm, RoPE), the in-place cache writes and the attention of a step in one node, with the semantics of
 * pagedkit's reference kernel (pagedkit/kernels/paged/reference.py) for float (float16 / bfloat16) caches.
 * Built and loaded by pagedkit/kernels/cpu/build.py; nodes written by pagedkit/kernels/cpu/lower.py.
 *
 * Ops: "PagedAttention_<io>_<t>_<c>": io = the query / key / value / output element type (f32, or t),
 * t = the node's T (f16 / bf16: what Q is rounded to, cos / sin / head_sink / norm weights' type),
 * c = the caches' element type. io f32: the node absorbed the Casts f32 -> T before it and T -> f32 after it,
 * so the inputs are rounded to T on entry and the output rounded to T and widened back, exactly as those Casts.
 *
 * Inputs (an absent optional input is an empty name in the node):
 *   0 query [T, H*D] or packed QKV [T, (H + 2 Hkv) * D]   1 key [T, Hkv*D] (opt)   2 value [T, Hkv*D] (opt)
 *   3 key_cache [NB, BS, Hkv, D]   4 value_cache (same)   -- written in place (the input buffers themselves)
 *   5 cumulative_sequence_length [B+1] int32   6 past_seqlens [B] int32   7 block_table [B, MB] int32
 *   8 cos_cache [P, R/2] (opt)   9 sin_cache (opt)   10 head_sink [H] (opt)
 *   11 q_norm_weight [D] (opt)   12 k_norm_weight [D] (opt)   13 slot_mapping [T] int32 (opt)
 *   14 query_positions [T] int32 (opt)
 * Output: 0 output [T, H*D].
 * Attributes: num_heads, kv_num_heads, scale (f), softcap (f), local_window_size, do_rotary, rotary_interleaved,
 *   is_causal, rotary_offset, qk_norm_epsilon (f); threads (the most threads the attention may use),
 *   ort_parallel_min (the step's keys x heads from which its token x KV-head items go over onnxruntime's intra-op
 *   pool, KernelContext_ParallelFor, onnxruntime 1.17+; -1: never) and parallel_min (from which they go over
 *   pool.h's threads otherwise: a decode step's few microseconds are not worth waking a sleeping thread).
 *
 * The caches are updated in the input buffers: the op has no cache outputs; the caller (runtime/delegate.py)
 * returns the cache inputs as the node's present outputs. Everything is computed in float32; Q is rounded to T
 * after the prologue and K / V to the cache type when stored, then read back from the cache (as the reference).
 *
 * onnxruntime's C API is reached through the function table OrtApiBase::GetApi(16) returns: only the slots
 * below are called (their positions in that table, which onnxruntime only ever appends to), and the op is
 * described by the OrtCustomOp layout of API version 16 (CreateKernelV2 / KernelComputeV2 report errors).
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- the onnxruntime ABI this file uses ------------------------------------------------------------------- */
typedef struct OrtStatus OrtStatus;
typedef struct OrtApi OrtApi;
typedef struct OrtValue OrtValue;
typedef struct OrtKernelInfo OrtKernelInfo;
typedef struct OrtKernelContext OrtKernelContext;
typedef struct OrtSessionOptions OrtSessionOptions;
typedef struct OrtCustomOpDomain OrtCustomOpDomain;
typedef struct OrtTensorTypeAndShapeInfo OrtShapeInfo;
typedef struct OrtApiBase {
  const OrtApi* (*GetApi)(uint32_t version);
  const char* (*GetVersionString)(void);
} OrtApiBase;

enum { ELEM_FLOAT = 1, ELEM_INT32 = 6, ELEM_FLOAT16 = 10, ELEM_BFLOAT16 = 16 };
enum { ORT_FAIL = 1, ORT_INVALID_ARGUMENT = 2 };
enum { REQUIRED = 0, OPTIONAL = 1 };
#define API_VERSION 16

/* slots of OrtApi */
enum {
  S_CreateStatus = 0, S_CreateCustomOpDomain = 26, S_CustomOpDomain_Add = 27, S_AddCustomOpDomain = 28,
  S_GetTensorMutableData = 51, S_GetTensorElementType = 60, S_GetDimensionsCount = 61, S_GetDimensions = 62,
  S_GetTensorTypeAndShape = 65, S_KernelInfoGetAttribute_float = 85, S_KernelInfoGetAttribute_int64 = 86,
  S_KernelContext_GetInputCount = 88, S_KernelContext_GetInput = 90, S_KernelContext_GetOutput = 91,
  S_ReleaseStatus = 93, S_ReleaseTensorTypeAndShapeInfo = 99,
  S_KernelContext_ParallelFor = 274  /* API version 17 (onnxruntime 1.17) and later */
};
#define PARALLEL_FOR_VERSION 17
#define SLOT(api, i) (((void* const*)(api))[i])
typedef OrtStatus* (*CreateStatusFn)(int, const char*);
typedef OrtStatus* (*CreateDomainFn)(const char*, OrtCustomOpDomain**);
typedef OrtStatus* (*DomainAddFn)(OrtCustomOpDomain*, const void*);
typedef OrtStatus* (*AddDomainFn)(OrtSessionOptions*, OrtCustomOpDomain*);
typedef OrtStatus* (*MutableDataFn)(OrtValue*, void**);
typedef OrtStatus* (*ElemTypeFn)(const OrtShapeInfo*, int*);
typedef OrtStatus* (*DimCountFn)(const OrtShapeInfo*, size_t*);
typedef OrtStatus* (*DimsFn)(const OrtShapeInfo*, int64_t*, size_t);
typedef OrtStatus* (*TypeShapeFn)(const OrtValue*, OrtShapeInfo**);
typedef OrtStatus* (*AttrFloatFn)(const OrtKernelInfo*, const char*, float*);
typedef OrtStatus* (*AttrIntFn)(const OrtKernelInfo*, const char*, int64_t*);
typedef OrtStatus* (*InputCountFn)(const OrtKernelContext*, size_t*);
typedef OrtStatus* (*GetInputFn)(const OrtKernelContext*, size_t, const OrtValue**);
typedef OrtStatus* (*GetOutputFn)(OrtKernelContext*, size_t, const int64_t*, size_t, OrtValue**);
typedef void (*ReleaseStatusFn)(OrtStatus*);
typedef OrtStatus* (*ParallelForFn)(const OrtKernelContext*, void (*)(void*, size_t), size_t, size_t, void*);
typedef void (*ReleaseShapeFn)(OrtShapeInfo*);

typedef struct CustomOp {  /* OrtCustomOp, API version 16 */
  uint32_t version;
  void* (*CreateKernel)(const struct CustomOp*, const OrtApi*, const OrtKernelInfo*);
  const char* (*GetName)(const struct CustomOp*);
  const char* (*GetExecutionProviderType)(const struct CustomOp*);
  int (*GetInputType)(const struct CustomOp*, size_t);
  size_t (*GetInputTypeCount)(const struct CustomOp*);
  int (*GetOutputType)(const struct CustomOp*, size_t);
  size_t (*GetOutputTypeCount)(const struct CustomOp*);
  void (*KernelCompute)(void*, OrtKernelContext*);
  void (*KernelDestroy)(void*);
  int (*GetInputCharacteristic)(const struct CustomOp*, size_t);
  int (*GetOutputCharacteristic)(const struct CustomOp*, size_t);
  int (*GetInputMemoryType)(const struct CustomOp*, size_t);
  int (*GetVariadicInputMinArity)(const struct CustomOp*);
  int (*GetVariadicInputHomogeneity)(const struct CustomOp*);
  int (*GetVariadicOutputMinArity)(const struct CustomOp*);
  int (*GetVariadicOutputHomogeneity)(const struct CustomOp*);
  OrtStatus* (*CreateKernelV2)(const struct CustomOp*, const OrtApi*, const OrtKernelInfo*, void**);
  OrtStatus* (*KernelComputeV2)(void*, OrtKernelContext*);
} CustomOp;

#include "pool.h"
#include "simd.h"

/* ---- the kernel ------------------------------------------------------------------------------------------- */
typedef struct Kernel {
  const OrtApi* api;
  int io, t, c;  /* element kinds */
  int64_t heads, kv_heads, window, rotary, interleaved, causal, rotary_offset, threads, parallel_min, ort_parallel_min;
  float scale, softcap, eps;
} Kernel;

typedef struct OpDef { CustomOp base; const char* name; int io, t, c; } OpDef;

static int elem_of(int kind) { return kind == 0 ? ELEM_FLOAT : kind == 1 ? ELEM_FLOAT16 : ELEM_BFLOAT16; }

static OrtStatus* fail(const OrtApi* api, const char* fmt, long long a, long long b) {
  char msg[256];
  snprintf(msg, sizeof msg, fmt, a, b);
  char full[320];
  snprintf(full, sizeof full, "pagedkit.cpu PagedAttention: %s", msg);
  return ((CreateStatusFn)SLOT(api, S_CreateStatus))(ORT_INVALID_ARGUMENT, full);
}

static float attr_f(const OrtApi* api, const OrtKernelInfo* info, const char* name, float dflt) {
  float v;
  OrtStatus* st = ((AttrFloatFn)SLOT(api, S_KernelInfoGetAttribute_float))(info, name, &v);
  if (st) { ((ReleaseStatusFn)SLOT(api, S_ReleaseStatus))(st); return dflt; }
  return v;
}
static int64_t attr_i(const OrtApi* api, const OrtKernelInfo* info, const char* name, int64_t dflt) {
  int64_t v;
  OrtStatus* st = ((AttrIntFn)SLOT(api, S_KernelInfoGetAttribute_int64))(info, name, &v);
  if (st) { ((ReleaseStatusFn)SLOT(api, S_ReleaseStatus))(st); return dflt; }
  return v;
}

static OrtStatus* create_v2(const CustomOp* op, const OrtApi* api, const OrtKernelInfo* info, void** out) {
  const OpDef* d = (const OpDef*)op;
  Kernel* k = (Kernel*)calloc(1, sizeof(Kernel));
  if (!k) return ((CreateStatusFn)SLOT(api, S_CreateStatus))(ORT_FAIL, "pagedkit.cpu PagedAttention: out of memory");
  k->api = api; k->io = d->io; k->t = d->t; k->c = d->c;
  k->heads = attr_i(api, info, "num_heads", 0);
  k->kv_heads = attr_i(api, info, "kv_num_heads", 0);
  k->window = attr_i(api, info, "local_window_size", -1);
  k->rotary = attr_i(api, info, "do_rotary", 0);
  k->interleaved = attr_i(api, info, "rotary_interleaved", 0);
  k->causal = attr_i(api, info, "is_causal", 1);
  k->rotary_offset = attr_i(api, info, "rotary_offset", 0);
  k->threads = attr_i(api, info, "threads", 1);
  k->parallel_min = attr_i(api, info, "parallel_min", 8192);
  k->ort_parallel_min = attr_i(api, info, "ort_parallel_min", -1);
  k->scale = attr_f(api, info, "scale", 0.f);
  k->softcap = attr_f(api, info, "softcap", 0.f);
  k->eps = attr_f(api, info, "qk_norm_epsilon", 1e-6f);
  if (k->heads <= 0 || k->kv_heads <= 0 || k->heads % k->kv_heads) {
    free(k);
    return ((CreateStatusFn)SLOT(api, S_CreateStatus))(ORT_INVALID_ARGUMENT,
        "pagedkit.cpu PagedAttention: num_heads must be a positive multiple of kv_num_heads");
  }
  *out = k;
  return NULL;
}

typedef struct Tensor { const OrtValue* v; void* data; int64_t dims[4]; size_t rank; int elem; } Tensor;

static OrtStatus* get(const OrtApi* api, OrtKernelContext* ctx, size_t count, size_t i, Tensor* t) {
  memset(t, 0, sizeof *t);
  if (i >= count) return NULL;
  OrtStatus* st = ((GetInputFn)SLOT(api, S_KernelContext_GetInput))(ctx, i, &t->v);
  if (st || !t->v) { t->v = NULL; return st; }
  OrtShapeInfo* info;
  if ((st = ((TypeShapeFn)SLOT(api, S_GetTensorTypeAndShape))(t->v, &info))) return st;
  st = ((DimCountFn)SLOT(api, S_GetDimensionsCount))(info, &t->rank);
  if (!st && t->rank > 4) st = fail(api, "input %lld has rank %lld (at most 4)", (long long)i, (long long)t->rank);
  if (!st) st = ((DimsFn)SLOT(api, S_GetDimensions))(info, t->dims, t->rank);
  if (!st) st = ((ElemTypeFn)SLOT(api, S_GetTensorElementType))(info, &t->elem);
  ((ReleaseShapeFn)SLOT(api, S_ReleaseTensorTypeAndShapeInfo))(info);
  if (!st) st = ((MutableDataFn)SLOT(api, S_GetTensorMutableData))((OrtValue*)t->v, &t->data);
  return st;
}

static void rms_norm(float* x, int d, const void* w, int kind, float eps) {
  float ss = dot_ff(x, x, d);
  float inv = 1.0f / sqrtf(ss / (float)d + eps);
  for (int i = 0; i < d; i++) x[i] = x[i] * inv * load1(w, (size_t)i, kind);
}

static void rope(float* x, const float* cs, const float* sn, int half, int off, int interleaved) {
  float* seg = x + off;
  if (interleaved) {
    for (int c = 0; c < half; c++) {
      float a = seg[2 * c], b = seg[2 * c + 1];
      seg[2 * c] = a * cs[c] - b * sn[c];
      seg[2 * c + 1] = b * cs[c] + a * sn[c];
    }
  } else {
    for (int c = 0; c < half; c++) {
      float a = seg[c], b = seg[c + half];
      seg[c] = a * cs[c] - b * sn[c];
      seg[c + half] = b * cs[c] + a * sn[c];
    }
  }
}

/* One step's geometry and inputs, shared by the prologue and the attention. */
typedef struct Step {
  const Kernel* K;
  int H, HKV, G, D, half, packed;
  int64_t T, B, NB, BS, MB, width;
  const int32_t *csl, *past, *bt, *sm, *qp;
  const void *query, *key, *value, *cos, *sin, *sink, *qn, *kn;
  int64_t cos_rows;
  uint16_t *kcache, *vcache;
  void* out;
} Step;

#define CHECK(cond, fmt, a, b) do { if (!(cond)) { st = fail(api, fmt, (long long)(a), (long long)(b)); goto done; } } while (0)

/* 1. token t's prologue (QKV split, QK-norm, RoPE, Q rounded to T) and its cache write; q: its [H * D] row */
static OrtStatus* prologue(const Step* S, int64_t t, int64_t b, float* q, float* kb, float* vb, float* cs, float* sn) {
  const Kernel* K = S->K;
  const OrtApi* api = K->api;
  OrtStatus* st = NULL;
  const size_t qw = (size_t)S->H * S->D, kw = (size_t)S->HKV * S->D;
  const int64_t j = t - S->csl[b], dpos = S->past[b] + j, pos = S->qp ? S->qp[t] : dpos;
  CHECK(pos >= 0, "token %lld: position %lld < 0", t, pos);
  if (S->packed) {
    const size_t row = (size_t)t * (size_t)S->width;
    to_f32(q, S->query, row, qw, K->io);
    to_f32(kb, S->query, row + qw, kw, K->io);
    to_f32(vb, S->query, row + qw + kw, kw, K->io);
  } else {
    to_f32(q, S->query, (size_t)t * qw, qw, K->io);
    to_f32(kb, S->key, (size_t)t * kw, kw, K->io);
    to_f32(vb, S->value, (size_t)t * kw, kw, K->io);
  }
  if (K->io == 0) {  /* the folded Casts float32 -> T */
    round_row(q, qw, K->t);
    round_row(kb, kw, K->t);
    round_row(vb, kw, K->t);
  }
  if (S->qn) {
    for (int h = 0; h < S->H; h++) rms_norm(q + (size_t)h * S->D, S->D, S->qn, K->t, K->eps);
    for (int h = 0; h < S->HKV; h++) rms_norm(kb + (size_t)h * S->D, S->D, S->kn, K->t, K->eps);
  }
  if (K->rotary) {
    CHECK(pos < S->cos_rows, "cos_cache has %lld positions, a token needs position %lld", S->cos_rows, pos);
    to_f32(cs, S->cos, (size_t)pos * S->half, (size_t)S->half, K->t);
    to_f32(sn, S->sin, (size_t)pos * S->half, (size_t)S->half, K->t);
    for (int h = 0; h < S->H; h++) rope(q + (size_t)h * S->D, cs, sn, S->half, (int)K->rotary_offset, (int)K->interleaved);
    for (int h = 0; h < S->HKV; h++) rope(kb + (size_t)h * S->D, cs, sn, S->half, (int)K->rotary_offset, (int)K->interleaved);
  }
  round_row(q, qw, K->t);  /* the prologue's Q is a T tensor */
  int64_t slot;
  if (S->sm) {
    slot = S->sm[t];
    CHECK(slot >= -1 && slot < S->NB * S->BS, "slot_mapping entry %lld out of range [-1, %lld)", slot, S->NB * S->BS);
  } else {
    const int64_t col = dpos / S->BS;
    CHECK(col < S->MB, "token %lld writes beyond block_table's %lld blocks", t, S->MB);
    const int64_t blk = S->bt[b * S->MB + col];
    slot = blk >= 0 && blk < S->NB ? blk * S->BS + dpos % S->BS : -1;
  }
  if (slot >= 0) {  /* in the cache's type, rounded to nearest even (the reference's x.to(cache dtype)) */
    from_f32(S->kcache, (size_t)slot * kw, kb, kw, K->c);
    from_f32(S->vcache, (size_t)slot * kw, vb, kw, K->c);
  }
done:
  return st;
}

/* 2. token t's attention for the G query heads of KV head g over its sequence's admitted context, read back
 * from the caches. rows / scores / kf / acc: scratch of maxc rows, G * maxc scores, D and G * D floats. */
static void attend(const Step* S, int64_t t, int64_t b, int g, const float* q, int64_t maxc, int64_t* rows,
                   float* scores, float* kf, float* acc) {
  const Kernel* K = S->K;
  const int G = S->G, D = S->D, HKV = S->HKV;
  const int64_t BS = S->BS, MB = S->MB, NB = S->NB;
  const int64_t extent = (int64_t)S->past[b] + S->csl[b + 1] - S->csl[b];
  const int64_t pos = S->qp ? S->qp[t] : (int64_t)S->past[b] + (t - S->csl[b]);
  int64_t hi = extent - 1, lo = 0;
  if (K->causal && pos < hi) hi = pos;
  if (K->window > 0 && pos - K->window + 1 > lo) lo = pos - K->window + 1;
  int64_t n = 0;  /* the admitted keys' cache rows, in position order */
  for (int64_t col = lo / BS; lo <= hi && col <= hi / BS && col < MB; col++) {
    const int64_t blk = S->bt[b * MB + col];
    if (blk < 0 || blk >= NB) continue;  /* unmapped: masked */
    const int64_t k0 = col * BS > lo ? col * BS : lo, k1 = (col + 1) * BS - 1 < hi ? (col + 1) * BS - 1 : hi;
    for (int64_t kp = k0; kp <= k1; kp++) rows[n++] = (blk * BS + kp % BS) * HKV + g;
  }
  (void)maxc;
  const float scale = K->scale != 0.f ? K->scale : 1.0f / sqrtf((float)D);
  memset(acc, 0, sizeof(float) * (size_t)G * D);
  const int fast = group_fast(G, D, K->c);  /* simd.h: the group's heads held in registers (same sums, same order) */
  if (n > 0) {
    if (fast)
      qk_group(scores, q + (size_t)g * G * D, (const uint16_t*)S->kcache, rows, n, G, D, K->c, scale);
    else
      for (int64_t i = 0; i < n; i++) {  /* scores: each K row widened once for the group's heads */
        to_f32(kf, S->kcache, (size_t)rows[i] * D, (size_t)D, K->c);
        for (int h = 0; h < G; h++) scores[(size_t)h * n + i] = dot_ff(q + (size_t)(g * G + h) * D, kf, D) * scale;
      }
    for (int h = 0; h < G; h++) {
      float* s = scores + (size_t)h * n;
      if (K->softcap > 0.f)
        for (int64_t i = 0; i < n; i++) s[i] = K->softcap * tanhf(s[i] / K->softcap);
      float m = max_of(s, (size_t)n), sink = 0.f;
      if (S->sink) { sink = load1(S->sink, (size_t)(g * G + h), K->t); m = sink > m ? sink : m; }
      float den = exp_sum(s, (size_t)n, m);
      if (S->sink) den += expf(sink - m);
      scale_row(s, (size_t)n, 1.0f / den);
    }
    if (fast)
      pv_group(acc, scores, (const uint16_t*)S->vcache, rows, n, G, D, K->c);
    else
      for (int64_t i = 0; i < n; i++) {  /* p @ V: each V row widened once */
        to_f32(kf, S->vcache, (size_t)rows[i] * D, (size_t)D, K->c);
        for (int h = 0; h < G; h++) axpy_ff(acc + (size_t)h * D, scores[(size_t)h * n + i], kf, D);
      }
  }  /* else: no admitted key, output 0 */
  const size_t qw = (size_t)S->H * D;
  for (int h = 0; h < G; h++) {
    float* o = acc + (size_t)h * D;
    round_row(o, (size_t)D, K->t);  /* the output in T (widened back when io is float32) */
    from_f32(S->out, (size_t)t * qw + (size_t)(g * G + h) * D, o, (size_t)D, K->io);
  }
}

/* the attention's work items: (token, KV head), each with its worker's scratch */
typedef struct Attend {
  const Step* S;
  const float* qbuf;
  const int64_t* seq;
  int64_t maxc;
  char* scratch;
  size_t stride;
} Attend;

static size_t scratch_bytes(const Step* S, int64_t maxc) {
  size_t n = sizeof(int64_t) * (size_t)(maxc > 0 ? maxc : 1) + sizeof(float) * ((size_t)S->G * (size_t)maxc +
             (size_t)(S->G + 1) * (size_t)S->D);
  return (n + 63) & ~(size_t)63;
}

/* the API table that has KernelContext_ParallelFor (GetApi(PARALLEL_FOR_VERSION)), NULL before onnxruntime 1.17 */
static const OrtApi* ORT_POOL = NULL;

static void attend_item(void* arg, int64_t item, int worker);
typedef struct Drain { void* job; int64_t n; atomic_llong next; } Drain;
static void drain_items(void* arg, size_t worker) {  /* one call per thread of onnxruntime's ParallelFor */
  Drain* d = (Drain*)arg;
  for (int64_t i; (i = atomic_fetch_add(&d->next, 1)) < d->n;) attend_item(d->job, i, (int)worker);
}

static void attend_item(void* arg, int64_t item, int worker) {
  const Attend* A = (const Attend*)arg;
  const Step* S = A->S;
  const int64_t t = item / S->HKV;
  const int g = (int)(item % S->HKV);
  char* mem = A->scratch + A->stride * (size_t)worker;
  int64_t* rows = (int64_t*)mem;
  float* scores = (float*)(mem + sizeof(int64_t) * (size_t)(A->maxc > 0 ? A->maxc : 1));
  float* kf = scores + (size_t)S->G * (size_t)A->maxc;
  float* acc = kf + S->D;
  attend(S, t, A->seq[t], g, A->qbuf + (size_t)t * S->H * S->D, A->maxc, rows, scores, kf, acc);
}

static OrtStatus* compute_v2(void* kernel, OrtKernelContext* ctx) {
  Kernel* K = (Kernel*)kernel;
  const OrtApi* api = K->api;
  OrtStatus* st = NULL;
  float *qbuf = NULL, *work = NULL;
  int64_t* seq = NULL;
  char* scratch = NULL;
  size_t count = 0;
  if ((st = ((InputCountFn)SLOT(api, S_KernelContext_GetInputCount))(ctx, &count))) return st;
  Tensor in[15];
  for (size_t i = 0; i < 15; i++)
    if ((st = get(api, ctx, count, i, &in[i]))) return st;
  Step S;
  memset(&S, 0, sizeof S);
  S.K = K;
  S.H = (int)K->heads; S.HKV = (int)K->kv_heads; S.G = S.H / S.HKV;
  const Tensor *query = &in[0], *key = &in[1], *value = &in[2], *kc = &in[3], *vc = &in[4];
  const Tensor *csl_t = &in[5], *past_t = &in[6], *bt_t = &in[7], *cos_t = &in[8], *sin_t = &in[9];
  const Tensor *sm_t = &in[13], *qp_t = &in[14];
  CHECK(query->v && query->rank == 2, "query must be 2-D (rank %lld)%lld", query->rank, 0);
  S.packed = !key->v && !value->v;
  CHECK(S.packed || (key->v && value->v), "key and value must be both present or both absent%lld%lld", 0, 0);
  S.T = query->dims[0]; S.width = query->dims[1];
  const int64_t per = S.packed ? S.H + 2 * S.HKV : S.H;
  CHECK(S.width % per == 0, "query width %lld is not a multiple of %lld heads", S.width, per);
  S.D = (int)(S.width / per);
  const int64_t T = S.T, H = S.H, HKV = S.HKV, D = S.D;
  CHECK(kc->v && vc->v && kc->rank == 4 && vc->rank == 4, "caches must be 4-D%lld%lld", 0, 0);
  S.NB = kc->dims[0]; S.BS = kc->dims[1];
  for (int i = 0; i < 4; i++) CHECK(kc->dims[i] == vc->dims[i], "value_cache dim %lld differs from key_cache's (%lld)", i, kc->dims[i]);
  CHECK(kc->dims[2] == HKV && kc->dims[3] == D, "key_cache [.., .., %lld, %lld] does not match kv_num_heads / head_size", kc->dims[2], kc->dims[3]);
  if (!S.packed) {
    CHECK(key->rank == 2 && key->dims[0] == T && key->dims[1] == HKV * D, "key shape [%lld, %lld] is wrong", key->dims[0], key->dims[1]);
    CHECK(value->rank == 2 && value->dims[0] == T && value->dims[1] == HKV * D, "value shape [%lld, %lld] is wrong", value->dims[0], value->dims[1]);
  }
  CHECK(csl_t->v && past_t->v && bt_t->v && bt_t->rank == 2, "sequence inputs missing or block_table not 2-D%lld%lld", 0, 0);
  S.B = past_t->dims[0]; S.MB = bt_t->dims[1];
  CHECK(csl_t->dims[0] == S.B + 1 && bt_t->dims[0] == S.B, "cumulative_sequence_length has %lld entries, batch %lld", csl_t->dims[0], S.B);
  S.csl = (const int32_t*)csl_t->data; S.past = (const int32_t*)past_t->data; S.bt = (const int32_t*)bt_t->data;
  CHECK(S.csl[0] == 0 && S.csl[S.B] == T, "cumulative_sequence_length must run from 0 to token_count %lld (ends at %lld)", T, S.csl[S.B]);
  for (int64_t b = 0; b < S.B; b++) {
    CHECK(S.csl[b + 1] >= S.csl[b] && S.past[b] >= 0, "sequence %lld: lengths must be non-negative%lld", b, 0);
    CHECK((int64_t)S.past[b] + S.csl[b + 1] - S.csl[b] <= S.MB * S.BS, "sequence %lld holds more tokens than block_table covers (%lld)", b, S.MB * S.BS);
  }
  if (K->rotary) {
    CHECK(cos_t->v && sin_t->v && cos_t->rank == 2 && sin_t->rank == 2, "do_rotary needs 2-D cos_cache and sin_cache%lld%lld", 0, 0);
    S.half = (int)cos_t->dims[1];
    S.cos_rows = cos_t->dims[0];
    CHECK(sin_t->dims[0] == S.cos_rows && sin_t->dims[1] == S.half, "sin_cache [%lld, %lld] differs from cos_cache", sin_t->dims[0], sin_t->dims[1]);
    CHECK(K->rotary_offset + 2 * S.half <= D, "rotary range ends at %lld beyond head_size %lld", K->rotary_offset + 2 * S.half, D);
  }
  S.sm = sm_t->v ? (const int32_t*)sm_t->data : NULL;
  S.qp = qp_t->v ? (const int32_t*)qp_t->data : NULL;
  CHECK(!S.sm || sm_t->dims[0] == T, "slot_mapping has %lld entries, token_count %lld", sm_t->dims[0], T);
  CHECK(!S.qp || qp_t->dims[0] == T, "query_positions has %lld entries, token_count %lld", qp_t->dims[0], T);
  CHECK(!in[11].v == !in[12].v, "q_norm_weight and k_norm_weight go together%lld%lld", 0, 0);
  CHECK(!in[10].v || in[10].dims[0] == H, "head_sink has %lld entries, num_heads %lld", in[10].dims[0], H);
  CHECK(!in[11].v || (in[11].dims[0] == D && in[12].dims[0] == D), "norm weights must have head_size %lld entries%lld", D, 0);
  S.query = query->data; S.key = key->data; S.value = value->data; S.cos = cos_t->data; S.sin = sin_t->data;
  S.sink = in[10].v ? in[10].data : NULL; S.qn = in[11].v ? in[11].data : NULL; S.kn = in[12].v ? in[12].data : NULL;
  S.kcache = (uint16_t*)kc->data; S.vcache = (uint16_t*)vc->data;

  int64_t out_dims[2] = {T, H * D};
  OrtValue* out_v;
  if ((st = ((GetOutputFn)SLOT(api, S_KernelContext_GetOutput))(ctx, 0, out_dims, 2, &out_v))) goto done;
  if ((st = ((MutableDataFn)SLOT(api, S_GetTensorMutableData))(out_v, &S.out))) goto done;
  if (T == 0) goto done;

  const size_t qw = (size_t)H * D, kw = (size_t)HKV * D;
  const int64_t maxc = S.MB * S.BS;
  qbuf = (float*)malloc(sizeof(float) * (size_t)T * qw);
  seq = (int64_t*)malloc(sizeof(int64_t) * (size_t)T);
  work = (float*)malloc(sizeof(float) * (2 * kw + 2 * (size_t)(S.half + 1)));
  CHECK(qbuf && seq && work, "out of memory (%lld tokens, context %lld)", T, maxc);
  float *kb = work, *vb = kb + kw, *cs = vb + kw, *sn = cs + S.half + 1;
  int64_t b = 0, keys = 0;
  for (int64_t t = 0; t < T; t++) {  /* every token's cache write before any attention */
    while (t >= S.csl[b + 1]) b++;
    seq[t] = b;
    keys += (int64_t)S.past[b] + S.csl[b + 1] - S.csl[b];
    if ((st = prologue(&S, t, b, qbuf + (size_t)t * qw, kb, vb, cs, sn))) goto done;
  }
  /* attention, token x KV head items over the threads when there is enough of it (a decode step's is a few
   * microseconds: not worth a wake-up) */
  /* keys x heads from which the items go over onnxruntime's pool (its spinning workers: cheap to hand work to),
   * else over pool.h's sleeping threads (a wake-up costs: only for large steps) */
  const int64_t items = T * HKV;
  const int on_ort = ORT_POOL && K->ort_parallel_min >= 0 && keys * H >= K->ort_parallel_min;
  int threads = on_ort || keys * H >= K->parallel_min ? (int)K->threads : 1;
  if (threads > items) threads = (int)items;
  if (threads < 1) threads = 1;
  scratch = (char*)malloc(scratch_bytes(&S, maxc) * (size_t)threads);
  CHECK(scratch, "out of memory (context %lld, %lld threads)", maxc, threads);
  Attend job = {&S, qbuf, seq, maxc, scratch, scratch_bytes(&S, maxc)};
  if (threads > 1 && on_ort) {
    /* onnxruntime's own intra-op pool: its workers are the ones spinning between the session's nodes (a pool of
     * our own would wake threads onto cores they hold); `threads` calls, each draining items from one counter */
    Drain d = {&job, items, 0};
    st = ((ParallelForFn)SLOT(ORT_POOL, S_KernelContext_ParallelFor))(ctx, drain_items, (size_t)threads,
                                                                      (size_t)threads, &d);
  } else {
    parallel_for(items, attend_item, &job, threads);
  }
done:
  free(qbuf);
  free(seq);
  free(work);
  free(scratch);
  return st;
}

static void destroy(void* k) { free(k); }
static void* create_v1(const CustomOp* op, const OrtApi* api, const OrtKernelInfo* info) {
  void* k = NULL;
  OrtStatus* st = create_v2(op, api, info, &k);
  if (st) ((ReleaseStatusFn)SLOT(api, S_ReleaseStatus))(st);
  return k;
}
static void compute_v1(void* k, OrtKernelContext* ctx) {
  OrtStatus* st = compute_v2(k, ctx);
  if (st) ((ReleaseStatusFn)SLOT(((Kernel*)k)->api, S_ReleaseStatus))(st);
}
static const char* op_name(const CustomOp* op) { return ((const OpDef*)op)->name; }
static const char* op_ep(const CustomOp* op) { (void)op; return "CPUExecutionProvider"; }
static size_t n_inputs(const CustomOp* op) { (void)op; return 15; }
static size_t n_outputs(const CustomOp* op) { (void)op; return 1; }
static int input_type(const CustomOp* op, size_t i) {
  const OpDef* d = (const OpDef*)op;
  if (i <= 2) return elem_of(d->io);
  if (i <= 4) return elem_of(d->c);
  if (i <= 7 || i >= 13) return ELEM_INT32;
  return elem_of(d->t);  /* cos, sin, head_sink, norm weights */
}
static int output_type(const CustomOp* op, size_t i) { (void)i; return elem_of(((const OpDef*)op)->io); }
static int input_char(const CustomOp* op, size_t i) {
  (void)op;
  return i == 0 || (i >= 3 && i <= 7) ? REQUIRED : OPTIONAL;
}
static int output_char(const CustomOp* op, size_t i) { (void)op; (void)i; return REQUIRED; }
static int mem_default(const CustomOp* op, size_t i) { (void)op; (void)i; return 0; }
static int one(const CustomOp* op) { (void)op; return 1; }

static OpDef OPS[8];
static const char* NAMES[8] = {
  "PagedAttention_f16_f16_f16", "PagedAttention_f16_f16_bf16", "PagedAttention_bf16_bf16_f16",
  "PagedAttention_bf16_bf16_bf16", "PagedAttention_f32_f16_f16", "PagedAttention_f32_f16_bf16",
  "PagedAttention_f32_bf16_f16", "PagedAttention_f32_bf16_bf16"};
static const int KINDS[8][3] = {{1, 1, 1}, {1, 1, 2}, {2, 2, 1}, {2, 2, 2}, {0, 1, 1}, {0, 1, 2}, {0, 2, 1}, {0, 2, 2}};

/* the entry point onnxruntime's SessionOptions.register_custom_ops_library calls */
OrtStatus* RegisterCustomOps(OrtSessionOptions* options, const OrtApiBase* base) {
  /* never unloaded: the pool's workers (pool.h) sleep in this library's code; onnxruntime closes the library when
   * the last session using it goes, and a worker woken in unmapped code would crash the process */
  Dl_info self;
  if (dladdr((void*)RegisterCustomOps, &self) && self.dli_fname) dlopen(self.dli_fname, RTLD_NOW | RTLD_NODELETE);
  const OrtApi* api = base->GetApi(API_VERSION);
  if (!api) return NULL;  /* cannot report through an API we do not have; the session then refuses the ops */
  ORT_POOL = base->GetApi(PARALLEL_FOR_VERSION);  /* NULL on an older onnxruntime: pool.h's threads instead */
  OrtCustomOpDomain* domain = NULL;
  OrtStatus* st = ((CreateDomainFn)SLOT(api, S_CreateCustomOpDomain))("pagedkit.cpu", &domain);
  if (st) return st;
  for (int i = 0; i < 8; i++) {
    OpDef* d = &OPS[i];
    if (d->name) {  /* filled by an earlier registration (another session): the same values, left as they are */
      if ((st = ((DomainAddFn)SLOT(api, S_CustomOpDomain_Add))(domain, d))) return st;
      continue;
    }
    d->base.version = API_VERSION;
    d->base.CreateKernel = create_v1;
    d->base.GetName = op_name;
    d->base.GetExecutionProviderType = op_ep;
    d->base.GetInputType = input_type;
    d->base.GetInputTypeCount = n_inputs;
    d->base.GetOutputType = output_type;
    d->base.GetOutputTypeCount = n_outputs;
    d->base.KernelCompute = compute_v1;
    d->base.KernelDestroy = destroy;
    d->base.GetInputCharacteristic = input_char;
    d->base.GetOutputCharacteristic = output_char;
    d->base.GetInputMemoryType = mem_default;
    d->base.GetVariadicInputMinArity = one;
    d->base.GetVariadicInputHomogeneity = one;
    d->base.GetVariadicOutputMinArity = one;
    d->base.GetVariadicOutputHomogeneity = one;
    d->base.CreateKernelV2 = create_v2;
    d->base.KernelComputeV2 = compute_v2;
    d->io = KINDS[i][0]; d->t = KINDS[i][1]; d->c = KINDS[i][2];
    d->name = NAMES[i];  /* last: marks the entry filled */
    if ((st = ((DomainAddFn)SLOT(api, S_CustomOpDomain_Add))(domain, d))) return st;
  }
  return ((AddDomainFn)SLOT(api, S_AddCustomOpDomain))(options, domain);
}
