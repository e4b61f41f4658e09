/*
 * check.h - the checks the C tests share: CHECK prints the file, line and
 * condition of a failure and counts it; CHECK_OK and CHECK_FAIL test
 * ft_status results and the last error's text and argument position.
 * Each test's main returns `failures != 0`.
 */
#ifndef FT_TEST_CHECK_H
#define FT_TEST_CHECK_H

#include "flashtile.h"

#include <stdio.h>
#include <string.h>

static const ft_device CPU = {FT_CPU, 0};
static int failures = 0;

#define CHECK(cond, ...)                                                   \
    do {                                                                   \
        if (!(cond)) {                                                     \
            fprintf(stderr, "%s:%d: check failed: %s: ", __FILE__,         \
                    __LINE__, #cond);                                      \
            fprintf(stderr, __VA_ARGS__);                                  \
            fprintf(stderr, "\n");                                         \
            failures++;                                                    \
        }                                                                  \
    } while (0)

#define CHECK_OK(expr)                                                     \
    do {                                                                   \
        ft_status s_ = (expr);                                             \
        CHECK(s_ == FT_OK, "status %d: %s", (int)s_, ft_last_error());     \
    } while (0)

/* expr fails with status st, argument arg and a message containing text. */
#define CHECK_FAIL(expr, st, arg, text)                                    \
    do {                                                                   \
        ft_status s_ = (expr);                                             \
        CHECK(s_ == (st), "status %d, want %d (%s)", (int)s_, (int)(st),   \
              ft_last_error());                                            \
        CHECK(strstr(ft_last_error(), (text)) != NULL,                     \
              "message \"%s\" lacks \"%s\"", ft_last_error(), (text));     \
        CHECK(ft_last_error_arg() == (arg), "arg %d, want %d (%s)",        \
              ft_last_error_arg(), (arg), ft_last_error());                \
    } while (0)

#endif
