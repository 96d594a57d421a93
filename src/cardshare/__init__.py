"""Services of the cardshare.gpuhost collection.

The recorder modules (``fdinfo``, ``naming``, ``recorder``, ``cli``) use the standard library
only and are shipped as a zipapp; other modules may not.
"""
