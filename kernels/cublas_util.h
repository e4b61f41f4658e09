/*
 * cublas_util.h - flashtile's one cuBLAS module (matmul.cu), for the .cu
 * files that call cuBLAS (matmul.cu, attention/naive.cu): one handle per
 * device, kept for the process, and one way to turn a cuBLAS failure into
 * an ft_status. C++ only; lib/ never sees cuBLAS.
 */
#ifndef FT_CUBLAS_UTIL_H
#define FT_CUBLAS_UTIL_H

#include <cublas_v2.h>

#include "kernels.h"

#define FT_CUBLAS_MAX_DEVICES 64 /* devices 0 .. 63 get a handle */

/* The handle of device index, which must be the current device (a cuBLAS
 * handle belongs to the device current at its creation), created on first
 * use with the legacy default stream; errors name func. */
ft_status ft_cublas_handle(int index, const char *func, cublasHandle_t *out);

/* FT_ERR_NOMEM or FT_ERR_DEVICE for func: "what failed: cuBLAS's message
 * (its name, file:line)". */
ft_status ft_cublas_fail(cublasStatus_t st, const char *func, const char *what,
                         const char *file, int line);

#endif
