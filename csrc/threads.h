// Thread teams of the op dispatchers (csrc/<op>.cpp; never the per-ISA kernels, see
// csrc/topk_ip_common.h): how many threads a call takes, and a team that runs run(t) for each.
#pragma once
#include <algorithm>
#include <cstdint>

#ifdef RAGFAST_OPENMP
#include <omp.h>
#endif

namespace ragfast {

// `threads` (0: OpenMP's default; 1 without OpenMP), at most `most` and at least 1.
inline int team_size(int threads, int64_t most) {
  int T = 1;
#ifdef RAGFAST_OPENMP
  T = threads > 0 ? threads : omp_get_max_threads();
#else
  (void)threads;
#endif
  return int(std::max<int64_t>(1, std::min<int64_t>(T, most)));
}

// run(t) for t in [0, T), on a team of T threads (inline when T is 1: a team costs microseconds).
template <typename F>
void run_team(int T, const F& run) {
  if (T == 1) {
    run(0);
    return;
  }
#ifdef RAGFAST_OPENMP
#pragma omp parallel num_threads(T)
  run(omp_get_thread_num());
#else
  for (int t = 0; t < T; ++t) run(t);
#endif
}

}  // namespace ragfast
