// libFuzzer target for the safetensors reader (io/safetensors.h): any byte string must either be
// refused with a Status or parse into tensors that can all be read in full, without a crash, an
// out-of-bounds read (AddressSanitizer) or undefined behaviour (UBSan). Built by scripts/test.sh
// step 3 (clang, -DNIBBLE_FUZZ=ON); seeds in fuzz/corpus/safetensors_fuzz/.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "io/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using nibble::io::SafetensorsFile;
  auto file = SafetensorsFile::parse(data, size, "fuzz.safetensors");
  if (!file.is_ok()) {
    // A refusal is one line.
    if (std::strchr(file.status().message().c_str(), '\n') != nullptr) std::abort();
    return 0;
  }
  uint64_t sum = 0;
  for (const std::string& name : file->names()) {
    if (!file->contains(name) || !file->info(name).is_ok()) std::abort();
    auto t = file->get(name);
    if (!t.is_ok()) std::abort();  // a validated file must yield every tensor
    if (t->nbytes() != file->info(name)->data_end - file->info(name)->data_begin) std::abort();
    // Touch every byte so that ASan sees any read outside the parsed image.
    const auto* p = static_cast<const uint8_t*>(t->raw());
    for (size_t i = 0; i < t->nbytes(); ++i) sum += p[i];
  }
  for (const auto& [k, v] : file->metadata()) sum += k.size() + v.size();
  volatile uint64_t sink = sum;
  (void)sink;
  return 0;
}
