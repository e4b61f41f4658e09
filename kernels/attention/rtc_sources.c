/*
 * rtc_sources.c - the flash kernels' source files inside the library, for
 * rtc.cu's run-time compiles (a mod written in Lua): each file's bytes are
 * placed here by the assembler's .incbin when the library is built, so an
 * installed library needs no source tree. Beside them, the few standard
 * headers the kernels include, which NVRTC does not have (NVRTC has the
 * math functions built in; cuda_fp16.h and cuda_bf16.h come from the
 * toolkit's include directory).
 */
#define FT_INCBIN(sym, file)                                                                     \
    __asm__(".section .rodata\n.balign 16\n.hidden " #sym "\n" #sym ":\n.incbin \"" FT_KERNEL_DIR \
            "/" file "\"\n.byte 0\n.previous\n");                                                \
    extern const char sym[];

FT_INCBIN(ft_rtc_common, "attention/flash_common.cuh")
FT_INCBIN(ft_rtc_mma, "attention/flash_mma.cuh")
FT_INCBIN(ft_rtc_fwd, "attention/flash_fwd.cu")
FT_INCBIN(ft_rtc_bwd, "attention/flash_bwd.cu")
FT_INCBIN(ft_rtc_wgmma, "attention/sm90/flash_wgmma.cuh")
FT_INCBIN(ft_rtc_fwd90, "attention/sm90/flash_fwd_sm90.cu")
FT_INCBIN(ft_rtc_bwd90, "attention/sm90/flash_bwd_sm90.cu")
FT_INCBIN(ft_rtc_attn_mod, "../lib/attn_mod.h")
FT_INCBIN(ft_rtc_philox, "../lib/philox.h")
FT_INCBIN(ft_rtc_mask, "attention/mods_mask.cuh")

static const char stdint_h[] =
    "#pragma once\n"
    "typedef signed char int8_t; typedef unsigned char uint8_t;\n"
    "typedef short int16_t; typedef unsigned short uint16_t;\n"
    "typedef int int32_t; typedef unsigned int uint32_t;\n"
    "typedef long long int64_t; typedef unsigned long long uint64_t;\n"
    "typedef unsigned long long uintptr_t;\n";
static const char stddef_h[] = "#pragma once\ntypedef decltype(sizeof(0)) size_t;\n"
                               "#ifndef NULL\n#define NULL 0\n#endif\n";
static const char math_h[] = "#pragma once\n#define INFINITY __int_as_float(0x7f800000)\n";
static const char empty_h[] = "#pragma once\n";
static const char type_traits_h[] =
    "#pragma once\nnamespace std {\n"
    "template <class A, class B> struct is_same { static constexpr bool value = false; };\n"
    "template <class A> struct is_same<A, A> { static constexpr bool value = true; };\n}\n";

static const struct {
    const char *name, *text;
} files[] = {
    {"flash_common.cuh", ft_rtc_common},
    {"flash_mma.cuh", ft_rtc_mma},
    {"../flash_mma.cuh", ft_rtc_mma},
    {"flash_fwd.cu", ft_rtc_fwd},
    {"flash_bwd.cu", ft_rtc_bwd},
    {"flash_wgmma.cuh", ft_rtc_wgmma},
    {"sm90/flash_fwd_sm90.cu", ft_rtc_fwd90},
    {"sm90/flash_bwd_sm90.cu", ft_rtc_bwd90},
    {"attn_mod.h", ft_rtc_attn_mod},
    {"philox.h", ft_rtc_philox},
    {"mods_mask.cuh", ft_rtc_mask},
    {"stdint.h", stdint_h},
    {"stddef.h", stddef_h},
    {"math.h", math_h},
    {"stdlib.h", empty_h},
    {"string.h", empty_h},
    {"type_traits", type_traits_h},
};

int ft_rtc_file_count(void) { return (int)(sizeof files / sizeof files[0]); }
const char *ft_rtc_file_name(int i) { return files[i].name; }
const char *ft_rtc_file_text(int i) { return files[i].text; }
