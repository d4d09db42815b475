#include "engine_cuda/cublas_loader.h"

#include <dlfcn.h>

#include <string>
#include <type_traits>

#include "absl/strings/str_cat.h"

namespace pdserve::engine::cuda {
namespace {

std::string CublasSoname() {
  return absl::StrCat("libcublas.so.", CUBLAS_VER_MAJOR);
}

absl::StatusOr<CublasApi> Load() {
  const std::string soname = CublasSoname();
  // By soname first (LD_LIBRARY_PATH, the binary's run path, the system's
  // cache), then from the toolkit this was built against.
  void* library = dlopen(soname.c_str(), RTLD_NOW | RTLD_LOCAL);
  std::string reasons;
  if (library == nullptr) reasons = dlerror();
#ifdef PDSERVE_CUDA_LIBRARY_DIR
  if (library == nullptr) {
    const std::string path =
        absl::StrCat(PDSERVE_CUDA_LIBRARY_DIR, "/", soname);
    library = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (library == nullptr) absl::StrAppend(&reasons, "; ", dlerror());
  }
#endif
  if (library == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("cannot load cuBLAS (", soname, "): ", reasons));
  }
  // Never closed: cuBLAS handles live as long as the process's engines, and
  // unloading it under them would leave their calls dangling.
  CublasApi api;
  absl::Status missing;
  auto resolve = [&](auto& entry, const char* name) {
    void* symbol = dlsym(library, name);
    if (symbol == nullptr && missing.ok()) {
      missing = absl::FailedPreconditionError(
          absl::StrCat(soname, " has no entry point ", name));
    }
    entry = reinterpret_cast<std::remove_reference_t<decltype(entry)>>(symbol);
  };
  // The _v2 names are what cublas_v2.h's cublasCreate etc. expand to.
  resolve(api.create, "cublasCreate_v2");
  resolve(api.destroy, "cublasDestroy_v2");
  resolve(api.set_stream, "cublasSetStream_v2");
  resolve(api.set_workspace, "cublasSetWorkspace_v2");
  resolve(api.gemm_ex, "cublasGemmEx");
  if (!missing.ok()) return missing;
  return api;
}

}  // namespace

absl::StatusOr<const CublasApi*> LoadCublas() {
  // Loaded on first use and kept for the process's life (never destroyed,
  // so no engine outlives its table at exit).
  static const absl::StatusOr<CublasApi>* const loaded =
      new absl::StatusOr<CublasApi>(Load());
  if (!loaded->ok()) return loaded->status();
  return &loaded->value();
}

bool CublasMapped() {
  void* library = dlopen(CublasSoname().c_str(), RTLD_NOW | RTLD_NOLOAD);
  if (library == nullptr) return false;
  dlclose(library);  // drops only the reference RTLD_NOLOAD took
  return true;
}

}  // namespace pdserve::engine::cuda
