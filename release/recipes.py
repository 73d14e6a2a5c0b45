"""What each image is: the components, and per component its lock file, command, environment,
exposed ports, labels, what is left out of its dependencies layer, and the libraries it may need
without carrying them.

The runtime worker comes in two flavours: `cuda` (the release default: onnxruntime's CUDA build
with NVIDIA's CUDA 12 libraries, from `locks/runtime-worker-cuda.lock`) and `cpu`
(`locks/runtime-worker.lock`); both get the same tag and differ in the `io.modelforge.flavour`
label.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from modelforge_contracts.protocol import PROTOCOL_VERSION
from release._tar import rfc3339
from release.oci import SITE_DIR

COMPONENTS = ("control-plane", "node-agent", "runtime-worker")
FLAVOURS = ("cpu", "cuda")
Flavour = Literal["cpu", "cuda"]
DEFAULT_SOURCE = "https://github.com/modelforge/modelforge"


@dataclass(frozen=True)
class Recipe:
    lock: str
    cmd: tuple[str, ...]
    env: tuple[str, ...] = ()
    ports: tuple[str, ...] = ()
    labels: tuple[tuple[str, str], ...] = ()
    #: Glob patterns under SITE_DIR removed from the installed dependencies: what nothing in the
    #: image loads at run time (headers, static archives, providers whose libraries it lacks).
    unshipped: tuple[str, ...] = ()
    #: Libraries the image's ELF files may need without the image carrying them, each with the
    #: reason it is there at run time (see release.elfcheck); everything else must be inside.
    provided_at_run_time: tuple[tuple[str, str], ...] = ()
    #: Directories only this image has, owned by the image's user (mount points of volumes
    #: no other component uses), made in its dependencies layer; the shared base has the rest.
    own_directories: tuple[str, ...] = ()
    #: Programs `make install` built from pinned, hash-checked source that only this image
    #: carries, in its dependencies layer: (their path in the checkout, their path in the image).
    programs: tuple[tuple[str, str], ...] = ()


#: llama.cpp's `llama-server` (the `llama.cpp` runner's engine): built by `make install`
#: (scripts/build-llama-server; its source pinned in locks/llm.lock), carried by both worker
#: flavours as a CPU build, found by the worker through MODELFORGE_WORKER_LLAMA_SERVER.
LLAMA_SERVER_BUILT = "runtime_worker/bin/llama-server"
LLAMA_SERVER_IN_IMAGE = "opt/modelforge/bin/llama-server"
_LLAMA = ((LLAMA_SERVER_BUILT, LLAMA_SERVER_IN_IMAGE),)
_LLAMA_ENV = f"MODELFORGE_WORKER_LLAMA_SERVER=/{LLAMA_SERVER_IN_IMAGE}"


# The NVIDIA wheels' library directories: onnxruntime's CUDA provider carries no RUNPATH, so
# the loader finds cudart, cuBLAS, cuDNN, cuFFT and cuRAND here; cuBLAS and cuFFT load NVRTC
# and nvJitLink by name at run time.
_NVIDIA_LIBRARIES = (
    "cuda_runtime",
    "cublas",
    "cudnn",
    "cufft",
    "curand",
    "cuda_nvrtc",
    "nvjitlink",
)
_CUDA_UNSHIPPED = (
    "nvidia/*/include",  # C headers
    "nvidia/*/lib/*.a",  # static archives (cudart_static, cudadevrt, culibos)
    # TensorRT's provider: it needs libnvinfer, which the image does not carry.
    "onnxruntime/capi/libonnxruntime_providers_tensorrt.so",
    # NVRTC's alternative build, the FFTW and NVBLAS front ends: nothing loads them.
    "nvidia/cuda_nvrtc/lib/*.alt.so*",
    "nvidia/cufft/lib/libcufftw.so*",
    "nvidia/cublas/lib/libnvblas.so*",
)
_LIBCUDA = (
    "libcuda.so.1",
    "the NVIDIA driver's CUDA library, needed by cuDNN's runtime-compiled engines; the NVIDIA "
    "Container Toolkit injects it with the driver (NVIDIA_DRIVER_CAPABILITIES=compute)",
)


def recipe(component: str, flavour: str) -> Recipe:
    """The recipe of `component`; `flavour` matters only to the runtime worker."""
    if component == "control-plane":
        return Recipe(
            "control-plane.lock",
            ("python3", "-m", "control_plane"),
            env=("MODELFORGE_HOST=0.0.0.0", "MODELFORGE_DATA_DIR=/var/lib/modelforge"),
            ports=("8000/tcp",),
        )
    if component == "node-agent":
        return Recipe(
            "node-agent.lock",
            ("python3", "-m", "node_agent"),
            env=("NVIDIA_DRIVER_CAPABILITIES=utility",),
            # Its state volume: the agent names this path private in every job it hands over,
            # and a runtime worker that finds it readable must hide it from the job, which a
            # container without privileges cannot. So no other image has the directory.
            own_directories=("var/lib/modelforge/agent",),
        )
    if flavour == "cuda":
        library_path = ":".join(f"/{SITE_DIR}/nvidia/{name}/lib" for name in _NVIDIA_LIBRARIES)
        return Recipe(
            "runtime-worker-cuda.lock",
            ("python3", "-m", "runtime_worker"),
            env=(
                "NVIDIA_DRIVER_CAPABILITIES=compute,utility",
                f"LD_LIBRARY_PATH={library_path}",
                _LLAMA_ENV,
            ),
            labels=(("io.modelforge.flavour", flavour),),
            unshipped=_CUDA_UNSHIPPED,
            provided_at_run_time=(_LIBCUDA,),
            programs=_LLAMA,
        )
    return Recipe(
        "runtime-worker.lock",
        ("python3", "-m", "runtime_worker"),
        env=(_LLAMA_ENV,),
        labels=(("io.modelforge.flavour", flavour),),
        programs=_LLAMA,
    )


def image_name(component: str) -> str:
    return f"modelforge-{component}"


def image_labels(
    component: str,
    recipe: Recipe,
    *,
    version: str,
    revision: str,
    source_date_epoch: int,
    source: str,
) -> dict[str, str]:
    """The OCI labels every image carries, then the component's own."""
    return {
        "org.opencontainers.image.version": version,
        "org.opencontainers.image.revision": revision,
        "org.opencontainers.image.created": rfc3339(source_date_epoch),
        "org.opencontainers.image.source": source,
        "org.opencontainers.image.title": image_name(component),
        "org.opencontainers.image.licenses": "Apache-2.0",
        "io.modelforge.component": component,
        "io.modelforge.protocol": str(PROTOCOL_VERSION),
        **dict(recipe.labels),
    }
