"""Goodput under chaos (``python -m bench.chaos``, see ``__main__``): ``calibration`` sizes the run,
``schedule`` plans its faults and stop, ``analysis`` turns its events into ETTR and the Young/Daly model."""
