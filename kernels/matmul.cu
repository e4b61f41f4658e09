/*
 * matmul.cu - ft_cuda_matmul through cuBLAS: f64 in f64; f32, f16 and bf16
 * with f32 accumulation (never TF32), the result in the input dtype.
 * Operands come as cuBLAS reads them (ft_blas_layout): lib/ops.c copies
 * any other contiguous first.
 * Limits: devices 0 to 63 (one cuBLAS handle each, kept for the process).
 * Check: spec/cuda_ops_spec.lua (busted, tag gpu) against the CPU's CBLAS.
 * Design: kernels/README.md.
 */
#include <limits.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>

/* kernels.h brings internal.h in with C linkage: include it first. */
#include "kernels.h"

#include "cublas_util.h"
#include <nvtx3/nvToolsExtMemCudaRt.h>

#define F "ft_matmul"

static pthread_mutex_t handle_lock = PTHREAD_MUTEX_INITIALIZER;
static cublasHandle_t handles[FT_CUBLAS_MAX_DEVICES];

ft_status ft_cublas_fail(cublasStatus_t st, const char *func, const char *what,
                         const char *file, int line)
{
    const char *base = strrchr(file, '/');
    cudaGetLastError(); /* a CUDA error under a cuBLAS one is reported here */
    return ft_fail(st == CUBLAS_STATUS_ALLOC_FAILED ? FT_ERR_NOMEM : FT_ERR_DEVICE, func, 0,
                   "%s failed: %s (%s, %s:%d)", what, cublasGetStatusString(st),
                   cublasGetStatusName(st), base ? base + 1 : file, line);
}

#define CUBLAS_TRY(expr)                                 \
    do {                                                 \
        cublasStatus_t cublas_s_ = (expr);               \
        if (cublas_s_ != CUBLAS_STATUS_SUCCESS)          \
            return ft_cublas_fail(cublas_s_, F, #expr, __FILE__, __LINE__); \
    } while (0)

static nvtxDomainHandle_t nvtx_domain;
static pthread_once_t nvtx_once = PTHREAD_ONCE_INIT;

static void nvtx_init(void)
{
    nvtx_domain = nvtxDomainCreateA("flashtile");
}

void ft_cuda_mark_written(const void *p, size_t bytes)
{
    if (bytes == 0)
        return;
    pthread_once(&nvtx_once, nvtx_init);
    nvtxMemVirtualRangeDesc_t range;
    range.size = bytes;
    range.ptr = p;
    nvtxMemMarkInitializedBatch_t batch;
    batch.extCompatID = NVTX_EXT_COMPATID_MEM;
    batch.structSize = sizeof batch;
    batch.regionType = NVTX_MEM_TYPE_VIRTUAL_ADDRESS;
    batch.regionDescCount = 1;
    batch.regionDescElementSize = sizeof range;
    batch.regionDescElements = &range;
    nvtxMemCudaMarkInitialized(nvtx_domain, 0, 0, &batch);
}

ft_status ft_cublas_handle(int index, const char *func, cublasHandle_t *out)
{
    if (index < 0 || index >= FT_CUBLAS_MAX_DEVICES)
        return ft_fail(FT_ERR_UNSUPPORTED, func, 0,
                       "CUDA device %d: cuBLAS handles are kept for devices 0..%d only", index,
                       FT_CUBLAS_MAX_DEVICES - 1);
    ft_status st = FT_OK;
    pthread_mutex_lock(&handle_lock);
    if (!handles[index]) {
        cublasHandle_t h = NULL;
        cublasStatus_t e = cublasCreate(&h);
        if (e != CUBLAS_STATUS_SUCCESS) {
            st = ft_cublas_fail(e, func, "cublasCreate", __FILE__, __LINE__);
        } else if ((e = cublasSetStream(h, 0)) != CUBLAS_STATUS_SUCCESS) {
            st = ft_cublas_fail(e, func, "cublasSetStream", __FILE__, __LINE__);
            cublasDestroy(h);
        } else {
            handles[index] = h;
        }
    }
    *out = handles[index];
    pthread_mutex_unlock(&handle_lock);
    return st;
}

/* One operand as cuBLAS reads it: a [batch?, rows, cols] row-major view
 * with element (i, j) of batch b at data + b*bstride + i*rs + j*cs. */
typedef struct {
    const ft_tensor *t;
    int64_t bstride;
    cublasOperation_t op; /* applied to the column-major reading */
    int ld;
} mm_operand;

/* Fills o for t if cuBLAS can read t's strides; 0 if it cannot. */
static int describe(mm_operand *o, const ft_tensor *t)
{
    int transposed, ld;
    if (!ft_blas_layout(t, &transposed, &ld))
        return 0;
    o->t = t;
    o->bstride = t->ndim == 3 && t->shape[0] > 1 ? t->stride[0] : 0;
    /* The column-major reading of t's memory is t^T (row-major as it
     * lies) or t (transposed); the product wants t^T. */
    o->op = transposed ? CUBLAS_OP_T : CUBLAS_OP_N;
    o->ld = ld;
    return 1;
}

static ft_status gemm(cublasHandle_t h, ft_tensor *out, const mm_operand *A,
                      const mm_operand *B)
{
    const ft_tensor *a = A->t, *b = B->t;
    const int r = a->ndim - 2;
    const int64_t batches = a->ndim == 3 ? a->shape[0] : 1;
    const int m = (int)a->shape[r], k = (int)a->shape[r + 1];
    const int n = (int)b->shape[r + 1];
    const long long sc = (long long)m * n;
    const size_t es = ft_dtype_size(a->dtype);
    cudaDataType_t type;
    switch (a->dtype) {
    case FT_F32: type = CUDA_R_32F; break;
    case FT_F16: type = CUDA_R_16F; break;
    case FT_BF16: type = CUDA_R_16BF; break;
    default: type = CUDA_R_64F; break;
    }
    /* batchCount is an int: larger batches go in several calls. */
    for (int64_t done = 0; done < batches; done += INT_MAX) {
        const int count = (int)(batches - done < INT_MAX ? batches - done : INT_MAX);
        const char *pa = (const char *)a->data + done * A->bstride * (int64_t)es;
        const char *pb = (const char *)b->data + done * B->bstride * (int64_t)es;
        char *pc = (char *)out->data + done * sc * (int64_t)es;
        if (a->dtype == FT_F64) {
            const double one = 1.0, zero = 0.0;
            CUBLAS_TRY(cublasDgemmStridedBatched(
                h, B->op, A->op, n, m, k, &one, (const double *)pb, B->ld,
                B->bstride, (const double *)pa, A->ld, A->bstride, &zero,
                (double *)pc, n, sc, count));
        } else {
            const float one = 1.0f, zero = 0.0f;
            CUBLAS_TRY(cublasGemmStridedBatchedEx(
                h, B->op, A->op, n, m, k, &one, pb, type, B->ld, B->bstride,
                pa, type, A->ld, A->bstride, &zero, pc, type, n, sc, count,
                CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
        }
        ft_cuda_mark_written(pc, (size_t)(count * sc) * es);
    }
    return FT_OK;
}

ft_status ft_cuda_matmul(ft_tensor *out, const ft_tensor *a, const ft_tensor *b)
{
    FT_TRY(ft_cuda_use_device(a->device.index, F));
    if (ft_numel(out) == 0)
        return FT_OK;
    if (a->shape[a->ndim - 1] == 0) /* an empty sum: cuBLAS is not asked */
        return ft_cuda_fill(out, 0.0);
    cublasHandle_t h;
    FT_TRY(ft_cublas_handle(a->device.index, F, &h));
    mm_operand A, B;
    if (!describe(&A, a))
        return ft_fail(FT_ERR_INTERNAL, F, 1, "operand not readable by cuBLAS");
    if (!describe(&B, b))
        return ft_fail(FT_ERR_INTERNAL, F, 2, "operand not readable by cuBLAS");
    return gemm(h, out, &A, &B);
}
