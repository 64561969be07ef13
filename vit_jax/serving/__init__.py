"""Serving a checkpoint outside JAX: a SavedModel through jax2tf (`savedmodel`), TFLite
(`tflite`) and ONNX (`onnx`) converted from it, one call for all of them and for JAX
(`predictors`), and what prediction needs: image files (`images`), labels and top-k (`labels`).
`convert.write(loaded, out, format)` writes any of the formats."""
