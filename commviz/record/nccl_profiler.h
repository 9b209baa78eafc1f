/* The part of NCCL's profiler plugin API (version 5) that commviz's plugin uses.
 *
 * Declarations copied from NVIDIA/nccl v2.28.9-1, src/include/plugin/nccl_profiler.h,
 * src/include/plugin/profiler/profiler_v5.h and ext-profiler/example/nccl/{common,err}.h
 * (Copyright (c) 2015-2024, NVIDIA CORPORATION, BSD 3-clause license, see NCCL's LICENSE.txt),
 * cut down to what nccl_profiler.c reads. The layouts must stay exactly NCCL's: NCCL 2.28 looks
 * for the symbol ncclProfiler_v5 first and passes these structs as they are.
 */
#ifndef COMMVIZ_NCCL_PROFILER_H_
#define COMMVIZ_NCCL_PROFILER_H_

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

typedef enum { ncclSuccess = 0, ncclInternalError = 3 } ncclResult_t;

typedef void (*ncclDebugLogger_t)(int level, unsigned long flags, const char* file, int line,
                                  const char* fmt, ...);

enum {
  ncclProfileGroup = (1 << 0),
  ncclProfileColl = (1 << 1),
  ncclProfileP2p = (1 << 2),
  ncclProfileKernelCh = (1 << 6),
  ncclProfileGroupApi = (1 << 8),
  ncclProfileCollApi = (1 << 9),
  ncclProfileP2pApi = (1 << 10),
};

typedef int ncclProfilerEventState_v5_t;
enum { ncclProfilerKernelChStop = 22 };

typedef struct {
  uint64_t type;
  void* parentObj;
  int rank;
  union {
    struct { bool graphCaptured; int groupDepth; } groupApi;
    struct { const char* func; size_t count; const char* datatype; int root; void* stream;
             bool graphCaptured; } collApi;
    struct { const char* func; size_t count; const char* datatype; void* stream;
             bool graphCaptured; } p2pApi;
    struct { void* stream; } kernelLaunch;
    struct {
      uint64_t seqNumber;
      const char* func;
      void const* sendBuff;
      void* recvBuff;
      size_t count;
      int root;
      const char* datatype;
      uint8_t nChannels;
      uint8_t nWarps;
      const char* algo;
      const char* proto;
      void* parentGroup;
    } coll;
    struct {
      const char* func;
      void* buff;
      const char* datatype;
      size_t count;
      int peer;
      uint8_t nChannels;
      void* parentGroup;
    } p2p;
    struct { pid_t pid; uint8_t channelId; int peer; int nSteps; int chunkSize; int isSend; }
        proxyOp;
    struct { int step; } proxyStep;
    struct { uint8_t channelId; uint64_t pTimer; } kernelCh;
    struct { int64_t id; void* data; } netPlugin;
  };
} ncclProfilerEventDescr_v5_t;

typedef union {
  struct { size_t transSize; } proxyStep;
  struct { int appendedProxyOps; } proxyCtrl;
  struct { void* data; } netPlugin;
  struct { uint64_t pTimer; } kernelCh;
} ncclProfilerEventStateArgs_v5_t;

typedef struct {
  const char* name;
  ncclResult_t (*init)(void** context, uint64_t commId, int* eActivationMask,
                       const char* commName, int nNodes, int nranks, int rank,
                       ncclDebugLogger_t logfn);
  ncclResult_t (*startEvent)(void* context, void** eHandle, ncclProfilerEventDescr_v5_t* eDescr);
  ncclResult_t (*stopEvent)(void* eHandle);
  ncclResult_t (*recordEventState)(void* eHandle, ncclProfilerEventState_v5_t eState,
                                   ncclProfilerEventStateArgs_v5_t* eStateArgs);
  ncclResult_t (*finalize)(void* context);
} ncclProfiler_v5_t;

#endif
