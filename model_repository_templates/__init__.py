"""jinja2 templates of Triton model configs and of the python-backend entry file.

Data files of the wheel; found with importlib.resources so an installed snoozeml renders too.
"""
