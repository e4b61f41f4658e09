/*
 * consumer.c - a program that uses an installed flashtile, built either
 * with CMake (CMakeLists.txt: find_package(flashtile)) or with pkg-config
 * (Makefile). It runs an attention whose result is known: with every key
 * zero, each query weighs the keys alike, so each output row is the mean
 * of V's rows and LSE = log(N). Then it makes a mistake on purpose and
 * checks the error message. Prints "flashtile consumer: OK ..." and exits
 * 0 on success.
 */
#include <flashtile.h>

#include <math.h>
#include <stdio.h>
#include <string.h>

#define N 8 /* keys and queries */
#define H 2 /* heads */
#define D 4 /* head dim */

static int fail(const char *what)
{
    fprintf(stderr, "flashtile consumer: %s: %s\n", what, ft_last_error());
    return 1;
}

int main(void)
{
    const ft_device cpu = {FT_CPU, 0};
    const int64_t shape[4] = {1, N, H, D}; /* [batch, seqlen, heads, head_dim] */
    ft_tensor *q = NULL, *k = NULL, *v = NULL, *out = NULL, *lse = NULL, *bad = NULL;
    int rc = 1;

    if (ft_empty(&q, 4, shape, FT_F64, cpu) || ft_empty(&k, 4, shape, FT_F64, cpu) ||
        ft_empty(&v, 4, shape, FT_F64, cpu))
        return fail("ft_empty");
    if (ft_randn(q, 42, 0) || ft_fill(k, 0.0))
        goto done;
    /* v[0, j, h, d] = (j * H + h) * D + d */
    for (int64_t j = 0; j < N; j++)
        for (int64_t h = 0; h < H; h++)
            for (int64_t d = 0; d < D; d++) {
                const int64_t at[4] = {0, j, h, d};
                if (ft_set(v, at, (double)((j * H + h) * D + d)))
                    goto done;
            }

    ft_attn_params p;
    ft_attn_params_init(&p);
    if (ft_attention_forward(&out, &lse, q, k, v, &p)) {
        rc = fail("ft_attention_forward");
        goto done;
    }
    /* The mean over j of (j * H + h) * D + d is (N - 1) / 2 * H * D + h * D + d. */
    double worst = 0, sum = 0;
    for (int64_t i = 0; i < N; i++)
        for (int64_t h = 0; h < H; h++)
            for (int64_t d = 0; d < D; d++) {
                const int64_t at[4] = {0, i, h, d};
                double got;
                if (ft_get(out, at, &got))
                    goto done;
                double want = (N - 1) / 2.0 * H * D + (double)(h * D + d);
                worst = fmax(worst, fabs(got - want));
                sum += got;
            }
    for (int64_t h = 0; h < H; h++)
        for (int64_t i = 0; i < N; i++) {
            const int64_t at[3] = {0, h, i};
            double got;
            if (ft_get(lse, at, &got))
                goto done;
            worst = fmax(worst, fabs(got - log((double)N)));
        }
    if (worst > 1e-12) {
        fprintf(stderr, "flashtile consumer: attention is off by %g\n", worst);
        goto done;
    }

    /* A mistake: v with a head dim that is not k's. */
    const int64_t bad_shape[4] = {1, N, H, D + 1};
    if (ft_empty(&bad, 4, bad_shape, FT_F64, cpu))
        goto done;
    ft_tensor *out2 = NULL, *lse2 = NULL;
    if (ft_attention_forward(&out2, &lse2, q, k, bad, &p) == FT_OK || out2 || lse2 ||
        !strstr(ft_last_error(), "ft_attention_forward") || ft_last_error_arg() != 3) {
        fprintf(stderr, "flashtile consumer: a bad v was not reported as such (\"%s\")\n",
                ft_last_error());
        ft_tensor_free(out2);
        ft_tensor_free(lse2);
        goto done;
    }

    printf("flashtile consumer: OK (flashtile %s, attention output sum %.1f)\n", FT_VERSION, sum);
    rc = 0;
done:
    if (rc)
        fprintf(stderr, "flashtile consumer: failed (%s)\n", ft_last_error());
    ft_tensor_free(q);
    ft_tensor_free(k);
    ft_tensor_free(v);
    ft_tensor_free(out);
    ft_tensor_free(lse);
    ft_tensor_free(bad);
    return rc;
}
