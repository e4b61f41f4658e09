/*
 * safetensors.c - reading and writing .safetensors files.
 */
#include "internal.h"
