// zeroflat: the flat, partitioned parameter buffers of ZeRO stages 1, 2 and 3. The whole public
// API in one include.
//
// Start at the front doors, which run the one pipeline (probe, agreement, plan, execution,
// checks, master partition) for one group on every rank:
// - engine.h: flatten_param_group(), a group from its original storage on the device to its
//   ZeRO-1/2 flat buffer; FlattenOptions and FlattenResult, the options and result of every door
//   (with the executor's outcomes), and the `device` tier alone as building blocks.
// - loader.h: load(), a group straight from a checkpoint into the buffers a LoadPlacement names
//   (ZeRO-1/2's flat buffer or its slice, ZeRO-3's partitions, DTensor shards), each rank
//   reading only its share; load_read_bytes(), planned_reads() and verify_load() take the same
//   placement; shards that lie in the files as they are, mapped rather than read.
// - resume.h: plan_resume(), a DeepSpeed checkpoint resumed at any world size: the buffers each
//   rank keeps, their sources and placements, and each rank's reads.
// The other headers are their parts, usable alone: the vocabulary (common.h: errors, dtypes,
// tensor references, sizes, the checksum, read progress, runtime facts), the layouts (layout.h:
// ZeRO-1/2, ZeRO-3 and the rules by release; dtensor.h: DTensor shards), the planner (plan.h),
// the machine's facts (probe.h: hardware presets and the probe), devices (device.h),
// communicators (comm.h), models (model.h), checkpoints and model files (checkpoint.h,
// deepspeed_checkpoint.h, dcp_checkpoint.h) and the JSON reports (report.h).
// agree.h is the ranks' agreement the doors run; rehearsal.h is `zeroflat run`'s rehearsal of a
// model from a deterministic pattern.
#pragma once

#include "zeroflat/agree.h"
#include "zeroflat/checkpoint.h"
#include "zeroflat/comm.h"
#include "zeroflat/common.h"
#include "zeroflat/config.h"
#include "zeroflat/dcp_checkpoint.h"
#include "zeroflat/deepspeed_checkpoint.h"
#include "zeroflat/device.h"
#include "zeroflat/dtensor.h"
#include "zeroflat/engine.h"
#include "zeroflat/layout.h"
#include "zeroflat/loader.h"
#include "zeroflat/model.h"
#include "zeroflat/plan.h"
#include "zeroflat/probe.h"
#include "zeroflat/rehearsal.h"
#include "zeroflat/report.h"
#include "zeroflat/resume.h"
#include "zeroflat/save.h"
