// Graph capture behind the backend seam (CUDA graphs for the rollout engine's decode step,
// docs/architecture.md "CUDA graphs for the decode step"). A backend that can record the ops it is
// asked to run and replay them later as one launch implements GraphCapture; graph_capture(be)
// finds it, null where a backend runs every op eagerly (the CPU backend). Between begin_capture()
// and end_capture() ops are recorded, not run, and nothing may allocate, move data between host
// and backend memory or synchronise: those calls fail with a CheckError naming the op (the caller
// warms its buffers up with an eager call of the same shapes first); a free is held back until
// the capture ends. A graph keeps the pointers and scalars it was captured with, so it stays
// valid while none of the memory it touches is freed: memory_epoch() counts the backend's
// deallocations, and a graph captured at an earlier epoch is captured again before it is replayed.
#pragma once

#include <cstdint>
#include <memory>

#include "backend/backend.h"

namespace nibble::backend {

class CapturedGraph {
 public:
  virtual ~CapturedGraph() = default;
  // Runs the recorded ops again, in order, on the backend's stream (asynchronous, as any op).
  virtual void replay() = 0;
};

class GraphCapture {
 public:
  virtual ~GraphCapture() = default;
  // Starts recording the calling thread's ops. CheckError when a capture is already under way.
  virtual void begin_capture() = 0;
  // Ends the recording: the graph of the ops since begin_capture(). CheckError (and no capture
  // under way any more) when the recording failed.
  virtual std::unique_ptr<CapturedGraph> end_capture() = 0;
  // Ends a recording after an error inside it, dropping what was recorded; nothing when none runs.
  virtual void abort_capture() = 0;
  virtual bool capturing() const = 0;
  // Deallocations so far (see above).
  virtual int64_t memory_epoch() const = 0;
};

// The backend's capture, or null where it has none.
inline GraphCapture* graph_capture(Backend& be) { return dynamic_cast<GraphCapture*>(&be); }

}  // namespace nibble::backend
