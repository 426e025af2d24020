"""What is made from a finished run, above the training loop: export to safetensors / Hugging Face (`export`),
registration in an MLflow model registry (`register`), and loading a checkpoint to sample text (`inference`).

Importing the package is cheap; each module loads torch on import."""
