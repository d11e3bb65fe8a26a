/*
 * cpu-gaps [MiB] -- how much thread CPU time this machine charges at once
 * to a loop that does next to nothing.
 *
 * The loop reads CLOCK_THREAD_CPUTIME_ID over and over; between two reads
 * it runs no code of its own (with MiB: it increments one byte of a
 * buffer of that size, at random, touched beforehand so that no read
 * faults), so a jump between two reads is time charged to the thread
 * while something else had the CPU (the host holding the vCPU, or its
 * memory, interrupts) and the kernel did not account it elsewhere. The
 * benchmarks run it at nice 19 on every CPU while a server does background
 * work in slices, so that a slice's thread CPU time can be read next to
 * what the platform alone adds in the same period.
 *
 * Runs until SIGTERM or SIGINT; then prints one JSON line:
 * {"max_us": longest jump, "over_1ms": n, "over_2ms": n, "cpu_s": ..,
 *  "wall_s": .., "faults": page faults during the loop}
 */
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <time.h>

static volatile sig_atomic_t stop;

static void onSignal(int sig) {
    (void)sig;
    stop = 1;
}

static uint64_t clockNs(clockid_t c) {
    struct timespec t;
    clock_gettime(c, &t);
    return (uint64_t)t.tv_sec * 1000000000u + (uint64_t)t.tv_nsec;
}

int main(int argc, char **argv) {
    size_t len = argc > 1 ? (size_t)strtoul(argv[1], NULL, 10) << 20 : 0;
    volatile unsigned char *mem = NULL;
    if (len) {
        mem = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (mem == MAP_FAILED) {
            perror("cpu-gaps: mmap");
            return 1;
        }
        for (size_t o = 0; o < len; o += 4096) mem[o] = 1;
    }
    struct sigaction sa = {.sa_handler = onSignal};
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);
    struct rusage r0, r1;
    getrusage(RUSAGE_SELF, &r0);
    uint64_t x = 88172645463325252u;   /* xorshift64 */
    uint64_t w0 = clockNs(CLOCK_MONOTONIC), c0 = clockNs(CLOCK_THREAD_CPUTIME_ID);
    uint64_t last = c0, max = 0, over1 = 0, over2 = 0;
    while (!stop) {
        if (mem) {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            mem[(x % (len / 64)) * 64]++;
        }
        uint64_t c = clockNs(CLOCK_THREAD_CPUTIME_ID), d = c - last;
        last = c;
        if (d > max) max = d;
        if (d > 1000000) over1++;
        if (d > 2000000) over2++;
    }
    getrusage(RUSAGE_SELF, &r1);
    printf("{\"max_us\": %llu, \"over_1ms\": %llu, \"over_2ms\": %llu, "
           "\"cpu_s\": %.3f, \"wall_s\": %.3f, \"faults\": %ld}\n",
           (unsigned long long)(max / 1000), (unsigned long long)over1,
           (unsigned long long)over2, (double)(last - c0) / 1e9,
           (double)(clockNs(CLOCK_MONOTONIC) - w0) / 1e9,
           (r1.ru_minflt - r0.ru_minflt) + (r1.ru_majflt - r0.ru_majflt));
    return 0;
}
