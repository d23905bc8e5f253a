"""Layer 6, integrations: adapters that plug pyshmckpt into training frameworks.

Each adapter is a module of its own, imported only when used, so that importing pyshmckpt never
requires a framework.
"""
