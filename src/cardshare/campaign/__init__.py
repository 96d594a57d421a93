"""The re-encode campaign: win back disk by re-encoding 4K remuxes over VAAPI, never losing a
file, yielding to Plex and to the arbiter. Standard library only (ffmpeg and ffprobe do the
media work). ``python -m cardshare.campaign --config FILE`` runs it; ``cardshare campaign
status`` shows it."""
