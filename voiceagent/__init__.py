"""voiceagent"""
