/*
 * hvmem podman-run: a podman container with a broker region inside.
 *
 * Copyright (c) 2026 hybridvm contributors
 *
 * SPDX-License-Identifier: GPL-2.0-or-later
 */
#ifndef HVMEM_PODMAN_H
#define HVMEM_PODMAN_H

#include "client.h"

/*
 * hvmem podman-run NAME [--rw] -- PODMAN [GLOBAL-OPTIONS] run [RUN-OPTIONS]
 * IMAGE [ARGS] (@argv[0] is "podman-run").  Returns the container's exit
 * status, podman's when it could not create or start it, 1 when the broker
 * refused (*@errp set), 2 on a usage error or a container refused.
 */
int hvm_podman_run(HvmClient *c, int argc, char **argv, GError **errp);

#endif
