"""``ragfast export ...``: ONNX export of local Hugging Face models (NLI cross-encoders and encoders)."""
from __future__ import annotations

import json

import typer

__all__ = ["register"]


def register(app: typer.Typer) -> None:
    """Add the ``export`` group."""
    export_app = typer.Typer(help="Export local Hugging Face models to ONNX (shared by NLI and encoders).",
                             no_args_is_help=True)

    def _do(path: str, out: str, task: str, opset: int, max_length: int, parity: bool, int8: bool) -> None:
        from ragfast.encoders.export import export_onnx, parity_check, quantize_int8

        # The names every other command takes for a model slot: ``tiny`` (random weights) and,
        # for encoders, the bundled ``minilm``.
        if path == "tiny":
            from ragfast.models.tiny import tiny_path

            path = str(tiny_path("deberta-v2" if task == "sequence-classification" else "bert"))
        elif path == "minilm" and task == "feature-extraction":
            from ragfast.encoders.encoder import minilm_path

            path = str(minilm_path())
        f = export_onnx(path, out, task=task, opset=opset, max_length=max_length)
        info: dict = {"onnx": str(f), "task": task}
        if parity:
            info["parity"] = parity_check(path, f, task=task, max_length=min(max_length, 128))
        if int8:
            info["int8"] = str(quantize_int8(f, f.parent / "int8"))
        print(json.dumps(info, indent=2))

    @export_app.command("nli")
    def export_nli(path: str = typer.Argument(..., help="Local NLI cross-encoder directory, or 'tiny'."),
                   out: str = typer.Argument(..., help="Output directory (or a .onnx file name)."),
                   opset: int = typer.Option(17, help="ONNX opset."),
                   max_length: int = typer.Option(512, help="Longest pair the model will see."),
                   parity: bool = typer.Option(False, "--parity", help="Compare ONNX with torch on random pairs."),
                   int8: bool = typer.Option(False, "--int8", help="Also write a dynamic int8 model to OUT/int8.")) -> None:
        """Export a sequence-classification (NLI) model: graph output ``logits``."""
        _do(path, out, "sequence-classification", opset, max_length, parity, int8)

    @export_app.command("encoder")
    def export_encoder(path: str = typer.Argument(..., help="Local encoder directory (e.g. e5-base-v2), 'minilm' "
                                                  "(bundled) or 'tiny'."),
                       out: str = typer.Argument(..., help="Output directory (or a .onnx file name)."),
                       opset: int = typer.Option(17, help="ONNX opset."),
                       max_length: int = typer.Option(512, help="Longest input the model will see."),
                       parity: bool = typer.Option(False, "--parity", help="Compare ONNX with torch on random text."),
                       int8: bool = typer.Option(False, "--int8", help="Also write a dynamic int8 model to OUT/int8.")) -> None:
        """Export an encoder: graph output ``last_hidden_state`` (pooling stays outside)."""
        _do(path, out, "feature-extraction", opset, max_length, parity, int8)

    app.add_typer(export_app, name="export")
