"""Services of the cardshare.gpuhost collection.

The recorder modules (``fdinfo``, ``procscan``, ``naming``, ``recorder``, ``report``, ``cli``)
use the standard library only and are shipped as a zipapp; other modules may not.
"""
