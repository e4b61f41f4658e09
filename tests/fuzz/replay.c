/*
 * replay.c - runs a fuzz target's LLVMFuzzerTestOneInput over files,
 * without libFuzzer, so that the committed corpus and every input that
 * once crashed a loader stay a test in every build (ctest's
 * fuzz_replay_npy and fuzz_replay_safetensors, cmake/fuzz_replay.cmake).
 *
 *   fuzz_replay_npy [--expect-by-name] PATH...
 *
 * Each PATH is a file or a directory (its plain files, in name order; a
 * directory that does not exist counts zero files, as a regressions/
 * directory with nothing in it is not kept by git). A crash, a sanitizer
 * report or a failed check of the target (an abort) ends the run there;
 * the file being replayed is printed first. With --expect-by-name, a file
 * whose name starts with "ok-" must load and one starting with "err-"
 * must be rejected (the seed corpus is named so); other names may do
 * either. Prints one line per PATH, exits non-zero when an expectation
 * failed.
 */
#include "fuzz.h"

static int compare_names(const void *a, const void *b)
{
    return strcmp(*(char *const *)a, *(char *const *)b);
}

static int expect_by_name = 0;
static int failed = 0;
static int loaded = 0, rejected = 0;

/* Reads the whole of path (a plain file) into a fresh buffer. */
static uint8_t *read_file(const char *path, size_t *size)
{
    FILE *f = fopen(path, "rb");
    if (f == NULL) {
        fprintf(stderr, "replay: cannot open %s: %s\n", path, strerror(errno));
        exit(2);
    }
    size_t cap = 4096, n = 0;
    uint8_t *buf = malloc(cap);
    for (;;) {
        if (buf == NULL) {
            fprintf(stderr, "replay: out of memory reading %s\n", path);
            exit(2);
        }
        n += fread(buf + n, 1, cap - n, f);
        if (n < cap)
            break;
        cap *= 2;
        uint8_t *grown = realloc(buf, cap);
        if (grown == NULL)
            free(buf);
        buf = grown;
    }
    if (ferror(f)) {
        fprintf(stderr, "replay: cannot read %s\n", path);
        exit(2);
    }
    fclose(f);
    *size = n;
    return buf;
}

static void replay_file(const char *path)
{
    size_t size;
    uint8_t *data = read_file(path, &size);
    fprintf(stderr, "replay: %s (%zu bytes)\n", path, size);
    /* libFuzzer hands the target a buffer of exactly size bytes; so does
     * this copy, so that ASan sees any read past its end. */
    uint8_t *exact = malloc(size > 0 ? size : 1);
    if (exact == NULL) {
        fprintf(stderr, "replay: out of memory\n");
        exit(2);
    }
    memcpy(exact, data, size);
    free(data);
    ft_fuzz_loaded = -1;
    LLVMFuzzerTestOneInput(exact, size);
    free(exact);
    if (ft_fuzz_loaded == 1)
        loaded++;
    else
        rejected++;

    const char *base = strrchr(path, '/');
    base = base != NULL ? base + 1 : path;
    if (expect_by_name && strncmp(base, "ok-", 3) == 0 && ft_fuzz_loaded != 1) {
        fprintf(stderr, "replay: FAILED: %s should load, but: %s\n", path,
                ft_last_error());
        failed = 1;
    }
    if (expect_by_name && strncmp(base, "err-", 4) == 0 && ft_fuzz_loaded != 0) {
        fprintf(stderr, "replay: FAILED: %s should be rejected, but it loaded\n",
                path);
        failed = 1;
    }
}

static void replay_dir(const char *dir)
{
    DIR *d = opendir(dir);
    if (d == NULL) {
        if (errno == ENOENT) {
            printf("replay: %s: 0 files (no such directory)\n", dir);
            return;
        }
        fprintf(stderr, "replay: cannot open %s: %s\n", dir, strerror(errno));
        exit(2);
    }
    char **names = NULL;
    size_t n = 0, cap = 0;
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        if (e->d_name[0] == '.')
            continue;
        char path[FF_PATH_CAP];
        snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
        struct stat info;
        if (stat(path, &info) != 0 || !S_ISREG(info.st_mode))
            continue;
        if (n == cap) {
            cap = cap ? 2 * cap : 64;
            char **grown = realloc(names, cap * sizeof *names);
            if (grown == NULL) {
                fprintf(stderr, "replay: out of memory\n");
                exit(2);
            }
            names = grown;
        }
        names[n] = strdup(path);
        if (names[n] == NULL) {
            fprintf(stderr, "replay: out of memory\n");
            exit(2);
        }
        n++;
    }
    closedir(d);
    if (n > 1)
        qsort(names, n, sizeof *names, compare_names);
    const int loaded0 = loaded, rejected0 = rejected;
    for (size_t i = 0; i < n; i++) {
        replay_file(names[i]);
        free(names[i]);
    }
    free(names);
    printf("replay: %s: %zu files (%d loaded, %d rejected)\n", dir, n,
           loaded - loaded0, rejected - rejected0);
}

int main(int argc, char **argv)
{
    int paths = 0;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--expect-by-name") == 0) {
            expect_by_name = 1;
            continue;
        }
        struct stat info;
        if (stat(argv[i], &info) == 0 && S_ISREG(info.st_mode)) {
            replay_file(argv[i]);
            printf("replay: %s: %s\n", argv[i],
                   ft_fuzz_loaded == 1 ? "loaded" : "rejected");
        } else {
            replay_dir(argv[i]);
        }
        paths++;
    }
    if (paths == 0) {
        fprintf(stderr, "usage: %s [--expect-by-name] FILE-OR-DIRECTORY...\n",
                argv[0]);
        return 2;
    }
    if (failed)
        printf("replay: some files did not load or fail as their names say\n");
    return failed;
}
