/* glob.h -- Redis's glob matcher (see glob.c). */
#ifndef HYBRIDMEM_GLOB_H
#define HYBRIDMEM_GLOB_H
int stringmatchlen(const char *pattern, int patternLen,
                   const char *string, int stringLen, int nocase);
#endif
