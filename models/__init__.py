"""Model loading: catalogue names, GGUF files, MLX folders and Hugging Face repos onto mlx-lm models."""

from akunu.models import catalogue
from akunu.models.dtype_policy import DtypeChoice, choose_dtype
from akunu.models.loader import LoadedModel, load_model, load_tokenizer

__all__ = ["DtypeChoice", "LoadedModel", "catalogue", "choose_dtype", "load_model", "load_tokenizer"]
