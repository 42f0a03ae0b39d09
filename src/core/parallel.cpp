// OpenMP-backed thread count control (see parallel.h).
#include "core/parallel.h"

#include <omp.h>

namespace nibble {

int num_threads() { return omp_get_max_threads(); }
void set_num_threads(int n) { omp_set_num_threads(n > 0 ? n : 1); }

}  // namespace nibble
