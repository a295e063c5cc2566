from .prefix import *
