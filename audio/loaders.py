"""Load the audio models from local files (the model registry resolves names to paths)."""

from __future__ import annotations

from pathlib import Path


def load_whisper(model_dir: str | Path, device: str = "auto", compute_type: str = "auto",
                 cpu_threads: int = 0):
    """`cpu_threads`: CTranslate2's threads on a CPU; 0 keeps its default (4). With a count,
    numpy's BLAS (Whisper's mel features) gets as many: its default, one busy-waiting thread per
    core, took a second core from the engine at every transcript (measured on 2 cores: Whisper
    used 1.65 cores on 1 thread, and 1.0 after, in the same time)."""
    from faster_whisper import WhisperModel

    if device == "auto":
        import ctranslate2

        device = "cuda" if ctranslate2.get_cuda_device_count() > 0 else "cpu"
    if device == "cpu" and cpu_threads:
        numpy_blas_threads(cpu_threads)
    if compute_type == "auto":
        compute_type = "float16" if device == "cuda" else "int8"
    return WhisperModel(str(model_dir), device=device, compute_type=compute_type,
                        cpu_threads=cpu_threads)


def load_piper(onnx_path: str | Path, use_cuda: bool = False, cpu_threads: int = 0,
               spin: bool = False):
    """`cpu_threads`: onnxruntime's intra-op threads on a CPU; 0 keeps its default (one per
    core). `spin`: those threads spin between ops waiting for work (onnxruntime's default) rather
    than sleep: a few percent faster alone, but the spinning takes cycles from whatever shares
    the cores (in a call, the engine and Whisper).

    On a CPU the session runs without onnxruntime's memory arena: Piper's buffers are as long as
    each phrase, and the arena kept the largest it had seen, fragmented, and grew by doubling
    (+550 MB of RSS over the first calls of a soak, never returned; without it RSS stays flat).
    Without it a short phrase costs a few ms more (docs/BENCHMARKS.md, "Soak and memory")."""
    from piper import PiperVoice

    voice = PiperVoice.load(str(onnx_path), use_cuda=use_cuda)
    if not use_cuda:
        import onnxruntime

        # PiperVoice.load takes no session options: rebuild its session with ours.
        options = onnxruntime.SessionOptions()
        options.enable_cpu_mem_arena = False
        options.add_session_config_entry("session.intra_op.allow_spinning", "1" if spin else "0")
        if cpu_threads > 0:
            options.intra_op_num_threads = cpu_threads
        voice.session = onnxruntime.InferenceSession(
            str(onnx_path), sess_options=options, providers=["CPUExecutionProvider"])
    return voice


def load_silero(onnx_path: str | Path):
    from silero_vad.utils_vad import OnnxWrapper

    return OnnxWrapper(str(onnx_path), force_onnx_cpu=True)


def numpy_blas_threads(count: int | None = None) -> list[int]:
    """Set numpy's own BLAS to `count` threads, for this process from now on (the BLAS of other
    libraries, torch's among them, is left alone); returns its thread counts before."""
    import numpy
    from threadpoolctl import ThreadpoolController

    folder = Path(numpy.__file__).parent.parent  # site-packages: numpy/ and numpy.libs/
    mine = [lib for lib in ThreadpoolController().lib_controllers
            if lib.user_api == "blas" and Path(lib.filepath).is_relative_to(folder)
            and Path(lib.filepath).parts[len(folder.parts)].startswith("numpy")]
    before = [lib.num_threads for lib in mine]
    if count is not None:
        for lib in mine:
            lib.set_num_threads(count)
    return before

