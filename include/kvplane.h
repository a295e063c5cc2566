/* SPDX-License-Identifier: Apache-2.0 */
/* kvplane: where LLM KV-cache state lives and which worker serves the next
 * turn.  Umbrella header over include/kvplane/<module>.h. */
#ifndef KVPLANE_H
#define KVPLANE_H

#include "kvplane/common.h"
#include "kvplane/core.h"
#include "kvplane/text.h"
#include "kvplane/ledger.h"
#include "kvplane/prefix.h"
#include "kvplane/index.h"
#include "kvplane/route.h"
#include "kvplane/tier.h"
#include "kvplane/device.h"
#include "kvplane/config.h"

#endif /* KVPLANE_H */
