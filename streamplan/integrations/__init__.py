"""Host libraries: what streamplan knows of diffusers, transformers, accelerate, peft and ComfyUI, one folder or file
per library. ``recognizers`` holds every library's recognizers in the order they are tried, and the walk over a model;
a library file fills the extension points in ``streamplan.registries`` when it is imported."""
