// SPDX-License-Identifier: Apache-2.0
// The same consumer compiled as C++ (headers must be extern "C" clean).
#include "consumer.c"
