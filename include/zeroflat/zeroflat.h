// zeroflat: flat, partitioned ZeRO-1/2 parameter buffers. The whole public API in one include.
//
// Start at engine.h: flatten_param_group() takes a group from its original storage to its flat
// buffer on every rank (probe, agreement, plan, execution, master partition). The other headers
// are its parts, usable alone: the layout (layout.h), the planner (plan.h), the probe
// (probe.h), devices (device.h), communicators (comm.h), the executor (executor.h), model
// sources (model.h, model_source.h), reports (report.h) and rehearsals (rehearsal.h).
#pragma once

#include "zeroflat/agree.h"
#include "zeroflat/checkpoint.h"
#include "zeroflat/checksum.h"
#include "zeroflat/comm.h"
#include "zeroflat/config.h"
#include "zeroflat/device.h"
#include "zeroflat/dtype.h"
#include "zeroflat/engine.h"
#include "zeroflat/error.h"
#include "zeroflat/executor.h"
#include "zeroflat/flatten.h"
#include "zeroflat/hardware.h"
#include "zeroflat/layout.h"
#include "zeroflat/loader.h"
#include "zeroflat/model.h"
#include "zeroflat/model_source.h"
#include "zeroflat/pattern.h"
#include "zeroflat/plan.h"
#include "zeroflat/probe.h"
#include "zeroflat/rehearsal.h"
#include "zeroflat/release.h"
#include "zeroflat/report.h"
#include "zeroflat/runtime.h"
#include "zeroflat/size.h"
#include "zeroflat/tensor.h"
#include "zeroflat/zero3.h"
