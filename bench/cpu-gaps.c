/*
 * cpu-gaps -- how much thread CPU time this machine charges at once to a
 * loop that does nothing.
 *
 * The loop reads CLOCK_THREAD_CPUTIME_ID over and over; between two reads
 * it runs no code of its own, so a jump between two reads is time charged
 * to the thread while something else had the CPU (the host holding the
 * vCPU, interrupts) and the kernel did not account it elsewhere. The
 * benchmarks run it at nice 19 on every CPU while a server does background
 * work in slices, so that a slice's thread CPU time can be read next to
 * what the platform alone adds in the same period.
 *
 * Runs until SIGTERM or SIGINT; then prints one JSON line:
 * {"max_us": longest jump, "over_1ms": n, "over_2ms": n, "cpu_s": .., "wall_s": ..}
 */
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
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

int main(void) {
    struct sigaction sa = {.sa_handler = onSignal};
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);
    uint64_t w0 = clockNs(CLOCK_MONOTONIC), c0 = clockNs(CLOCK_THREAD_CPUTIME_ID);
    uint64_t last = c0, max = 0, over1 = 0, over2 = 0;
    while (!stop) {
        uint64_t c = clockNs(CLOCK_THREAD_CPUTIME_ID), d = c - last;
        last = c;
        if (d > max) max = d;
        if (d > 1000000) over1++;
        if (d > 2000000) over2++;
    }
    printf("{\"max_us\": %llu, \"over_1ms\": %llu, \"over_2ms\": %llu, "
           "\"cpu_s\": %.3f, \"wall_s\": %.3f}\n",
           (unsigned long long)(max / 1000), (unsigned long long)over1,
           (unsigned long long)over2, (double)(last - c0) / 1e9,
           (double)(clockNs(CLOCK_MONOTONIC) - w0) / 1e9);
    return 0;
}
