// See NOTE [Stream-safe reuse] in stream_order.h.
#include "core/stream_order.h"

#include <algorithm>

namespace memo::core {

void merge_use(std::vector<StreamUse>* uses, const StreamUse& use) {
  for (StreamUse& u : *uses) {
    if (u.stream == use.stream) {
      u.tick = std::max(u.tick, use.tick);
      return;
    }
  }
  uses->push_back(use);
}

StreamOrder::~StreamOrder() {
  for (auto& [stream, fence] : fences_)
    if (fence.event != 0) backend_->destroy_event(fence.event);
}

bool StreamOrder::known_complete(const StreamUse& use) const {
  auto it = fences_.find(use.stream);
  return it != fences_.end() && use.tick < it->second.done_tick;
}

void StreamOrder::prune(std::vector<StreamUse>* uses) const {
  uses->erase(std::remove_if(uses->begin(), uses->end(), [this](const StreamUse& u) { return known_complete(u); }),
              uses->end());
}

void StreamOrder::order_after(StreamId requester, const StreamUse& use) {
  if (use.stream == requester) return;  // stream order already serialises the two owners
  Fence& fence = fences_[use.stream];
  if (use.tick < fence.done_tick) return;
  std::uint64_t& waited = waited_[{requester, use.stream}];
  if (use.tick < waited) return;  // the requester already waits on an event recorded after this free
  if (fence.event != 0 && use.tick < fence.event_tick) {
    // The held event was recorded after this free, so it covers it: no new record.
    if (backend_->event_done(fence.event)) {
      // Everything the stream had queued before the event has run: every use
      // freed before it is complete, now and later. Drop the event.
      backend_->destroy_event(fence.event);
      fence.event = 0;
      fence.done_tick = fence.event_tick;
      return;
    }
  } else {
    // No event since this free: record one now (lazily). It covers all
    // earlier uses as well, so it replaces the one held.
    if (fence.event != 0) backend_->destroy_event(fence.event);
    fence.event = backend_->record_event(use.stream);
    fence.event_tick = ++clock_;
    stats_.events_recorded += 1;
    if (fence.event == 0) {  // the backend knows that work is complete already
      fence.done_tick = fence.event_tick;
      return;
    }
  }
  backend_->stream_wait_event(requester, fence.event);
  waited = fence.event_tick;
  stats_.stream_waits += 1;
}

}  // namespace memo::core
