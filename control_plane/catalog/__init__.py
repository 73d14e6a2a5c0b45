"""The model catalogue (WL-5c): immutable `name@version` entries."""
